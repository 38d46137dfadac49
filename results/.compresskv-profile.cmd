.venv/bin/python scripts/compresskv_profile.py --calib-samples 6 --budget 128 --target-tokens 1200 --out results/compresskv.csv 
