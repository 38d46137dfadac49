ripplekv fit compresskv --calib-samples 4 --calib-draw 0 --calib-draws 3 --budget 128 --target-tokens 1200 --out results/compresskv.csv
