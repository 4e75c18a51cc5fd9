# Benchmark targets, included from the Makefile (`include benchmarks/bench.mk`); uses its $(PY),
# $(VENV) and $(STAMP). Results (JSON and PNG) go to $(BENCH_OUT) (make bench: the tracked
# benchmarks/results) and $(DEMO_OUT) (make demo: an ignored folder, the clone stays clean).
#   make demo         the main job: a tiny GPT on 2 ranks joined by an emulated 100 Mbit/s link (the
#                     case the library is for), DDP + AdamW / fp16 / PowerSGD hooks against 1-bit Adam,
#                     1-bit LAMB and 0/1 Adam, and DiLoCo (fp32 and 1-bit pseudo-gradients every 30
#                     steps); then the same on 2 local ranks over loopback (no network bottleneck:
#                     DEMO_LOOPBACK=0 leaves it out); ~6 minutes on 2 CPU cores
#   make bench        the full comparison: every method, the small (9M) GPT, local ranks, and 2 ranks over
#                     an emulated 1 Gbit/s link, communication- and compute-bound
#   make bench-micro  pytest-benchmark micro-benchmarks of the kernels and collectives
# The link (benchmarks/slowlink.py): a veth pair between 2 network namespaces, tbf-limited each way;
# as root in named namespaces, as any other user inside a user namespace of its own (unshare
# --user --map-root-user --net --mount: no root needed). Where neither can be made (user
# namespaces disabled), make demo models the link instead (step + bytes / rate), and says so.
BENCH_OUT ?= benchmarks/results
BENCH_RUN = PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -P benchmarks/train.py --out-dir $(BENCH_OUT)
DEMO_OUT ?= .bench-results
DEMO_RUN = PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -P benchmarks/train.py --out-dir $(DEMO_OUT)
# 100 Mbit/s: the tiny GPT's fp32 allreduce (3.5 MB per rank and step) takes ~0.29 s on it, several
# times its compute on 2 CPU cores (~0.04-0.13 s), the 1-bit exchange (0.11 MB) ~9 ms. 120 steps
# (30 of warmup) keep both tables within ~5 minutes on 2 idle cores.
DEMO_LINK ?= 100mbit
DEMO_LOOPBACK ?= 1
DEMO_METHODS ?= ddp_adamw,ddp_fp16,ddp_powersgd+serial,onebit_adam,onebit_lamb,zero_one_adam,diloco_fp32,diloco_1bit
DEMO_ARGS ?= --model tiny --steps 120 --freeze-step 30 --batch 8 --breakdown --methods $(DEMO_METHODS)
# ddp_powersgd is torch's hook as is (on Gloo it can abort: reported as failed); +serial runs
# one DDP bucket at a time, which keeps the ranks' collectives in the same order.
# communication-bound on 1 Gbit/s: a 9M-parameter model, 2 x 32 bytes per rank and step.
BENCH_METHODS ?= ddp_adamw,ddp_fp16,ddp_powersgd,ddp_powersgd+serial,onebit_adam,onebit_adam+nooverlap,onebit_lamb,zero_one_adam
BENCH_SMALL ?= --model small --batch 2 --seq-len 32 --steps 300 --breakdown --methods $(BENCH_METHODS)
# compute-bound: 8 x 64 bytes per rank and step, the same model
BENCH_COMPUTE ?= --model small --batch 8 --seq-len 64 --steps 60 --freeze-step 15 --breakdown \
	--methods ddp_adamw,ddp_fp16,onebit_adam

.PHONY: demo bench bench-micro

demo: $(STAMP)
	@rc=0; \
	$(DEMO_RUN) $(DEMO_ARGS) --link $(DEMO_LINK) --name demo-link || rc=$$?; \
	if [ "$(DEMO_LOOPBACK)" != 0 ]; then \
		echo; \
		$(DEMO_RUN) $(DEMO_ARGS) --launch 2 --name demo-loopback || rc=$$?; \
	fi; \
	exit $$rc

bench: $(STAMP)
	@rc=0; \
	if $(PY) -P benchmarks/slowlink.py --check; then \
		$(BENCH_RUN) $(BENCH_SMALL) --link 1gbit --name small-1gbit || rc=$$?; \
		$(BENCH_RUN) $(BENCH_COMPUTE) --link 1gbit --name small-1gbit-computebound || rc=$$?; \
	else \
		echo "bench: skipping the 1 Gbit/s link runs (no emulated link here: see above)"; \
	fi; \
	$(BENCH_RUN) $(BENCH_SMALL) --launch 2 --name small-local || rc=$$?; \
	exit $$rc

bench-micro: $(STAMP)
	@mkdir -p $(BENCH_OUT)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -P -m pytest -p no:cacheprovider benchmarks/test_micro.py \
		--benchmark-json $(BENCH_OUT)/micro.json
