# Benchmark targets, included from the Makefile (`include benchmarks/bench.mk`); uses its $(PY),
# $(VENV) and $(STAMP). Results (JSON and PNG) go to $(BENCH_OUT).
#   make demo         the main job: 2 local ranks, tiny GPT, DDP + AdamW / fp16 / PowerSGD hooks
#                     against 1-bit Adam, 1-bit LAMB and 0/1 Adam, comparison table (< 5 minutes
#                     on 2 CPU cores)
#   make bench        the full comparison: every method, the small (9M) GPT, local ranks, and
#                     (as root) 2 ranks over an emulated 1 Gbit/s link, communication- and
#                     compute-bound
#   make bench-micro  pytest-benchmark micro-benchmarks of the kernels and collectives
BENCH_OUT ?= benchmarks/results
BENCH_RUN = PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -P benchmarks/train.py --out-dir $(BENCH_OUT)
DEMO_ARGS ?= --model tiny --launch 2 --steps 200 --freeze-step 80 --batch 8 --breakdown \
	--methods ddp_adamw,ddp_fp16,ddp_powersgd+serial,onebit_adam,onebit_lamb,zero_one_adam
# communication-bound on 1 Gbit/s: a 9M-parameter model, 2 x 32 bytes per rank and step.
# ddp_powersgd is torch's hook as is (on Gloo it can abort: reported as failed); +serial runs
# one DDP bucket at a time, which keeps the ranks' collectives in the same order.
BENCH_METHODS ?= ddp_adamw,ddp_fp16,ddp_powersgd,ddp_powersgd+serial,onebit_adam,onebit_adam+nooverlap,onebit_lamb,zero_one_adam
BENCH_SMALL ?= --model small --batch 2 --seq-len 32 --steps 300 --breakdown --methods $(BENCH_METHODS)
# compute-bound: 8 x 64 bytes per rank and step, the same model
BENCH_COMPUTE ?= --model small --batch 8 --seq-len 64 --steps 60 --freeze-step 15 --breakdown \
	--methods ddp_adamw,ddp_fp16,onebit_adam

.PHONY: demo bench bench-micro

demo: $(STAMP)
	$(BENCH_RUN) $(DEMO_ARGS) --name demo

bench: $(STAMP)
	@rc=0; \
	if [ "$$(id -u)" = 0 ]; then \
		$(BENCH_RUN) $(BENCH_SMALL) --link 1gbit --name small-1gbit || rc=$$?; \
		$(BENCH_RUN) $(BENCH_COMPUTE) --link 1gbit --name small-1gbit-computebound || rc=$$?; \
	else \
		echo "bench: skipping the 1 Gbit/s link runs (--link needs root for network namespaces)"; \
	fi; \
	$(BENCH_RUN) $(BENCH_SMALL) --launch 2 --name small-local || rc=$$?; \
	exit $$rc

bench-micro: $(STAMP)
	@mkdir -p $(BENCH_OUT)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -P -m pytest -p no:cacheprovider benchmarks/test_micro.py \
		--benchmark-json $(BENCH_OUT)/micro.json
