# DAWNBench recipes. `make quickstart` and `make test` work on a fresh clone: they set up the venv first.
# `make help` lists the targets: a `## ` comment line right above a target is its entry.
SHELL := /bin/bash
PYTHON_SYS ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCHRUN := $(VENV)/bin/torchrun
STAMP := $(VENV)/.installed

# Cluster launch (make resnet50-dawnbench NNODES=16 NODE_RANK=0 MASTER_ADDR=node0 DATA=/data/imagenet)
NNODES ?= 1
NODE_RANK ?= 0
MASTER_ADDR ?= 127.0.0.1
MASTER_PORT ?= 29500
GPUS_PER_NODE ?= 8
DATA ?= datasets/imagenet
NPROC ?= 2
ARGS ?=
# torchrun restarts the job this many times after a rank fails or is preempted; the ranks resume from the
# newest checkpoint by themselves (train.resume: auto).
MAX_RESTARTS ?= 3

.PHONY: help setup test test-fast test-long test-cluster horovod quickstart quickstart-2x2 digits resnet50-dawnbench resnet50-1node tensorboard bench bench-cluster-tta \
	transformer-quickstart transformer-wmt prepare-imagenet prepare-wmt

## list the targets with what each does
help:
	@awk '/^## /{doc = substr($$0, 4); next} /^[a-zA-Z0-9_.-]+:/{if (doc) {split($$1, t, ":"); \
	  printf "  make %-22s %s\n", t[1], doc}} {doc = ""}' $(MAKEFILE_LIST)

# The repository installs as an editable package after the pinned requirements; --no-build-isolation builds it with
# the venv's setuptools (requirements.txt) instead of fetching one into a throwaway environment.
## build .venv from requirements.txt and install the repository (once; again when they change)
setup: $(STAMP)
$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON_SYS) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PY) -c "from kernels._native import build_all; build_all()"
	touch $(STAMP)

# The tiers (tests/conftest.py): unit (no processes), dist (real gloo process groups), e2e (training runs,
# torchrun, faults), long (tests of 15 s or more each), cluster (root: network namespaces, tmpfs mounts). -rs
# lists every skip with its reason.
## the unit tier: no processes, a few minutes (run it on every edit)
test-fast: setup
	$(PY) -m pytest tests -q -rs --tier unit

## run the test suite: the unit, dist and e2e tiers (real gloo process groups, real files; no GPU needed)
test: setup
	$(PY) -m pytest tests -q -rs --tier unit,dist,e2e

## the long tier: tests of the other tiers that take 15 s or more each; CI runs it after make test
test-long: setup
	$(PY) -m pytest tests -q -rs --tier long

## the cluster tier (needs root: network namespaces, tmpfs mounts); CI runs it after make test
test-cluster: setup
	$(PY) -m pytest tests -q -rs --tier cluster $(ARGS)

# Horovod 0.28.1 patched for torch >= 2.1 and built from source (built once; the wheel is cached).
## build Horovod 0.28.1 for this torch (optional; its tests skip without it)
horovod: setup
	PY=$(PY) scripts/install_horovod.sh

## write the embedded default dataset (scikit-learn's digits) to datasets/digits
digits: setup
	$(PY) scripts/prepare_digits.py --out datasets/digits

# The data cache: fill L1 (node-local copies) and L3 (low-res arrays) for CONFIG ahead of a run, on
# every node (make cache CONFIG=configs/quickstart_cpu.yaml DATA=datasets/digits); otherwise epoch 1 fills them.
CONFIG ?= configs/resnet50_dawnbench.yaml
.PHONY: cache imagenet-like
## fill the node-local data cache for CONFIG and DATA ahead of a run
cache: setup
	$(PY) scripts/prepare_cache.py --config $(CONFIG) data.root=$(DATA) $(ARGS)

# The ImageNet-like folder of the input-pipeline benchmarks (scripts/bench/input_pipeline.py, data_wait.py):
# 3,000 + 500 real-photo JPEGs of 300-500 px.
## write the input-pipeline benchmarks' ImageNet-like folder to datasets/imagenet_like
imagenet-like: setup
	$(PY) scripts/make_imagenet_like.py --out datasets/imagenet_like

## train the ResNet-50 recipe on the digits on NPROC CPU processes, plot and report it
quickstart: digits
	$(TORCHRUN) --standalone --nproc_per_node $(NPROC) -m recipes.resnet50 --config configs/quickstart_cpu.yaml $(ARGS)
	$(PY) scripts/plot_tta.py runs/quickstart --out runs/quickstart/tta.png
	$(PY) scripts/dawnbench_report.py runs/quickstart --out runs/quickstart/dawnbench --hardware auto
	@echo "TensorBoard: make tensorboard   (logs in runs/quickstart/tensorboard)"

# The same run as 2 nodes x 2 ranks (4 processes): hitopk's intra-node reduce-scatter/allgather steps too.
## the quickstart as 2 nodes x 2 ranks (4 processes)
quickstart-2x2: digits
	$(TORCHRUN) --standalone --nproc_per_node 4 -m recipes.resnet50 --config configs/quickstart_cpu_2x2.yaml $(ARGS)
	$(PY) scripts/plot_tta.py runs/quickstart_2x2 --out runs/quickstart_2x2/tta.png

# Before the clock starts, each node fills its cache (L1 copies, L3 low-res arrays) with exactly the samples its
# GPUS_PER_NODE ranks will read in the run (scripts/prepare_cache.py --nnodes; a warm cache is checked from its
# manifest and index, reading no file). NOCACHE=1 skips that step (a config without data.cache.dir, or a cache filled
# by other means); epoch 1 then fills the cache as it reads. The rendezvous waits up to RDZV_TIMEOUT seconds
# (default 3600) for the nodes whose fill takes longest.
define cluster_run
	$(PY) -m data $(DATA)
	$(if $(NOCACHE),@echo "NOCACHE=$(NOCACHE): the cache is not filled ahead of the run",$(PY) \
	  scripts/prepare_cache.py --config $(1) --nnodes $(NNODES) --node-rank $(NODE_RANK) \
	  --ranks-per-node $(GPUS_PER_NODE) data.root=$(DATA) $(filter-out --resume,$(ARGS)))
	$(TORCHRUN) --nnodes $(NNODES) --node_rank $(NODE_RANK) --nproc_per_node $(GPUS_PER_NODE) \
	  --master_addr $(MASTER_ADDR) --master_port $(MASTER_PORT) --rdzv_conf timeout=$(or $(RDZV_TIMEOUT),3600) \
	  --max-restarts $(MAX_RESTARTS) -m recipes.resnet50 --config $(1) data.root=$(DATA) $(ARGS)
endef

## the DAWNBench ResNet-50 recipe, this node's part (NNODES NODE_RANK MASTER_ADDR GPUS_PER_NODE DATA)
resnet50-dawnbench: setup
	$(call cluster_run,configs/resnet50_dawnbench.yaml)

## the ResNet-50 recipe on one node of GPUS_PER_NODE GPUs (DATA)
resnet50-1node: setup
	$(call cluster_run,configs/resnet50_1node.yaml)

# The Transformer recipe on the embedded default: a generated English -> German corpus (seconds to prepare,
# once), trained on NPROC CPU processes to >= 60 sacreBLEU on held-out sentences; prints untrained vs trained BLEU.
## train the Transformer recipe on a generated En->De corpus on NPROC CPU processes
transformer-quickstart: setup
	$(PY) scripts/prepare_synthetic_translation.py --out datasets/synthetic_en_de
	$(TORCHRUN) --standalone --nproc_per_node $(NPROC) -m recipes.transformer \
	  --config configs/transformer_quickstart_cpu.yaml $(ARGS)
	@echo "TensorBoard: make tensorboard   (logs in runs/transformer_quickstart/tensorboard)"

# Transformer-big on WMT'16 En-De (make transformer-wmt NNODES=16 NODE_RANK=<n> MASTER_ADDR=<host> DATA=<dir>).
# DATA (default datasets/wmt16_en_de) must hold the corpus prepared by `python scripts/prepare_wmt.py --root DATA`;
# the check names the files it expected and how to prepare them.
WMT_DATA = $(if $(filter command line environment,$(origin DATA)),$(DATA),datasets/wmt16_en_de)
## Transformer-big on WMT'16 En-De, this node's part (NNODES NODE_RANK MASTER_ADDR GPUS_PER_NODE DATA)
transformer-wmt: setup
	$(PY) scripts/prepare_wmt.py --check --root $(WMT_DATA)
	$(TORCHRUN) --nnodes $(NNODES) --node_rank $(NODE_RANK) --nproc_per_node $(GPUS_PER_NODE) \
	  --master_addr $(MASTER_ADDR) --master_port $(MASTER_PORT) --max-restarts $(MAX_RESTARTS) \
	  -m recipes.transformer --config configs/transformer_wmt16_en_de.yaml data.root=$(WMT_DATA) $(ARGS)

# ImageNet from the official archives: ARCHIVES holds ILSVRC2012_img_train.tar, ILSVRC2012_img_val.tar and
# ILSVRC2012_devkit_t12.tar.gz (or LOC_val_solution.csv); DATA gets train/<wnid>/ and val/<wnid>/ (about 150 GB).
# Interrupted? Run it again: it finishes without redoing what is done. WORKERS class archives are extracted at once.
WORKERS ?= 4
## ImageNet from the official ILSVRC2012 archives in ARCHIVES to DATA (resumable; then the count check)
prepare-imagenet: setup
	@test -n "$(ARCHIVES)" || { echo "make prepare-imagenet: set ARCHIVES=<folder of the ILSVRC2012 archives> (and DATA=<dataset root>)"; exit 2; }
	$(PY) scripts/prepare_imagenet.py --archives $(ARCHIVES) --out $(DATA) --workers $(WORKERS)

# WMT'16 En-De from the raw archives in ARCHIVES (training-parallel-{europarl-v7,commoncrawl,nc-v11}.tgz, dev.tgz,
# optionally test-full.tgz): raw text, shared BPE and token ids in DATA (default datasets/wmt16_en_de).
## WMT'16 En-De from the raw .tgz archives in ARCHIVES to DATA (raw text, BPE, token ids)
prepare-wmt: setup
	@test -n "$(ARCHIVES)" || { echo "make prepare-wmt: set ARCHIVES=<folder of the WMT'16 .tgz archives> (and DATA=<corpus root>)"; exit 2; }
	$(PY) scripts/prepare_wmt.py --archives $(ARCHIVES) --root $(WMT_DATA)

# TensorBoard listens on this machine only (reach it from a laptop with `ssh -L 6006:localhost:6006 HOST`);
# TB_HOST=0.0.0.0 serves every interface: anyone who can reach the port sees the runs.
TB_HOST ?= localhost
TB_PORT ?= 6006
## serve TensorBoard for runs/ on TB_HOST:TB_PORT (default localhost:6006; TB_HOST=0.0.0.0 for every interface)
tensorboard: setup
	$(VENV)/bin/tensorboard --logdir runs --port $(TB_PORT) $(if $(filter 0.0.0.0,$(TB_HOST)),--bind_all,--host $(TB_HOST))

## run the micro-benchmarks of scripts/bench/ (ARGS=--quick for small sizes), then regenerate the results tables
bench: setup
	@for b in scripts/bench/*.py; do case $$b in */__init__.py|*/common.py|*/tta.py|*/scaling.py|*/choices.py|*/quickstart.py) continue;; esac; \
	  m=$${b%.py}; echo "== $$b"; $(PY) -m $${m//\//.} $(ARGS) || exit 1; done
	$(PY) -m scripts.results_tables

# The long benchmarks: each runs alone as `python -m scripts.bench.NAME $(ARGS)`, then the tables are regenerated.
LONG_BENCHES := bench-choices bench-quickstart bench-tta bench-scaling
$(LONG_BENCHES): bench-%: setup
	$(PY) -m scripts.bench.$* $(ARGS)
	$(PY) -m scripts.results_tables

## measured choices: the TTA recipe at its defaults against pinned precision x convolutions x communicator (ARGS=--screen: one epoch each)
bench-choices:
## the quickstarts timed: start-up measurement's share, time and accuracy (ARGS=--quick: the ResNet runs only)
bench-quickstart:
## time to accuracy, recipe against the tuned torchvision reference on fresh seeds (ARGS=--quick: 2 seeds)
bench-tta:
## step time of every exchange on an emulated cluster (root: network namespaces; ARGS=--quick)
bench-scaling:
## time to accuracy of every exchange on the emulated cluster (root; many hours; ARGS=--quick, ARGS="--resume OUT")
bench-cluster-tta: setup
	$(PY) -m scripts.bench.cluster_tta $(ARGS)
	$(PY) -m scripts.results_tables

# Emulated cluster on one machine (root; scripts/netem/): NODES network namespaces joined by RATE-shaped links,
# one torchrun per node (make netem-up NODES=2 RATE=1gbit; make netem-run NPROC=2 CONFIG=... ARGS=...; make netem-down).
# The scaling benchmark brings its own cluster up and down; `make plan` prints the cost model's plan (scripts/plan.py).
NODES ?= 2
RATE ?= 1gbit
.PHONY: netem-up netem-down netem-status netem-run plan
## bring up an emulated cluster of NODES namespaces joined by RATE-shaped links (root)
netem-up:
	scripts/netem/cluster.sh up $(NODES) $(RATE)
## tear the emulated cluster down
netem-down:
	scripts/netem/cluster.sh down
## show the emulated cluster
netem-status:
	scripts/netem/cluster.sh status
## run the ResNet recipe on the emulated cluster (NPROC per node, CONFIG, ARGS)
netem-run: setup
	PY=$(PY) scripts/netem/run.sh --nproc-per-node $(NPROC) -m recipes.resnet50 --config $(CONFIG) $(ARGS)
## print the cost model's plan for CONFIG (scripts/plan.py); RUN=<run folder of comm.kind auto>: replan its calibration
plan: setup
	$(PY) -m scripts.plan --config $(CONFIG) $(if $(RUN),--from-run $(RUN)) $(ARGS)

# A real single-node Slurm cluster on this machine (root; scripts/slurm/local_cluster.sh, tests/slurm_cluster.py):
# apt-get installs Slurm and munge if missing; `make slurm-up` prints the `export SLURM_CONF=...` for sbatch.
.PHONY: slurm-up slurm-down
## start a one-node Slurm cluster on this machine, to try scripts/slurm/*.sbatch on (root)
slurm-up: setup
	PYTHON=$(PY) scripts/slurm/local_cluster.sh up
## stop it: cancel its jobs, stop its daemons, remove its folder
slurm-down: setup
	PYTHON=$(PY) scripts/slurm/local_cluster.sh down
