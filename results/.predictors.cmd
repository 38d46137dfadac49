.venv/bin/python scripts/signal_vs_drop.py results/profile-evict results/profile results/profile-evict-kl results/profile-infonce --out results/predictors.csv 
