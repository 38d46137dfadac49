.venv/bin/ripplekv allocate results/profile-evict/sensitivity.csv --map proportional --out results/depthkv.csv 
