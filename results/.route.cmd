.venv/bin/ripplekv route --budget 128 --calib-samples 4 --placements 100 --placement-samples 8 --probe-tokens 16 --target-tokens 1200 --out results/route 
