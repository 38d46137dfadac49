ripplekv profile --calib-samples 4 --calib-draw 0 --calib-draws 3 --seeds 1 --eta 0.3 --probe-tokens 16 --target-tokens 1200 --out results/profile
