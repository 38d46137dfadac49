ripplekv route --budget 128 --calib-samples 4 --calib-draw 2 --calib-draws 3 --placements 0 --placement-samples 8 --probe-tokens 16 --target-tokens 1200 --out results/draws/d2/route
