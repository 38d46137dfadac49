.venv/bin/ripplekv route --budget 128 --calib-samples 4 --placements 100 --placement-samples 2 --probe-tokens 16 --target-tokens 3500 --out results/route 
