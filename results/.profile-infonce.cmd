ripplekv profile --signal infonce --calib-samples 6 --calib-draw 0 --calib-draws 3 --target-tokens 1200 --out results/profile-infonce
