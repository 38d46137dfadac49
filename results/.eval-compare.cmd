ripplekv eval --suite offline --tasks hotpotqa,niah --budget 512 --methods full,snapkv,gracekv,gracekv:slots=fixed --limit 5 --target-tokens 1200 --out results/eval-compare
