ripplekv allocate results/profile/sensitivity.csv --ratio 2 --ratio 4 --ratio 8 --budget 128 --calib-samples 4 --calib-draw 0 --calib-draws 3 --target-tokens 1200 --out results/allocation.csv
