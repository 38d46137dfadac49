ripplekv fit compresskv --calib-samples 4 --calib-draw 1 --calib-draws 3 --budget 128 --target-tokens 1200 --out results/draws/d1/compresskv-d1.csv
