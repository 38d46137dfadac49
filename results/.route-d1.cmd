ripplekv route --budget 128 --calib-samples 4 --calib-draw 1 --calib-draws 3 --placements 0 --placement-samples 8 --probe-tokens 16 --target-tokens 1200 --out results/draws/d1/route
