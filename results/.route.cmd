ripplekv route --budget 128 --calib-samples 4 --calib-draw 0 --calib-draws 3 --placements 50 --placement-samples 8 --probe-tokens 16 --target-tokens 1200 --out results/route
