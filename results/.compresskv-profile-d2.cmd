ripplekv fit compresskv --calib-samples 4 --calib-draw 2 --calib-draws 3 --budget 128 --target-tokens 1200 --out results/draws/d2/compresskv-d2.csv
