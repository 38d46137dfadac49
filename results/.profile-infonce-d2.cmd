ripplekv profile --signal infonce --calib-samples 6 --calib-draw 2 --calib-draws 3 --target-tokens 1200 --out results/draws/d2/profile-infonce
