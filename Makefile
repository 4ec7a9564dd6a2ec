# The course's two commands: `make lab` and `make test`. Everything else serves them.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip install --disable-pip-version-check -q -c constraints.txt
# --durations: the slowest cells and their times, at the end of each run (no cell should take a minute)
NBVAL  := $(BIN)/python -m pytest --nbval --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg --durations=8
# JupyterLab refuses to run as root unless told; containers often run as root.
ROOT_FLAG := $(shell [ "$$(id -u)" = 0 ] && echo --allow-root)

.PHONY: lab test install lint unit nbval nbval-other-cpu portability browser notebooks figures clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# pip byte-compiles the installed files one after another, half of the install's time; compileall does
# the same on every core. (It exits 1 on the few files in the packages that are not valid Python 3, test
# data among them, which pip skips as well: hence the leading -.)
COMPILE := $(BIN)/python -m compileall -q -j 0 $(VENV)/lib > /dev/null

$(VENV)/.course: $(BIN)/python pyproject.toml constraints.txt
	$(PIP) --no-compile -e .
	-$(COMPILE)
	touch $@

# One pip run for both (a second one would resolve the course's dependencies again)
$(VENV)/.test: $(BIN)/python pyproject.toml constraints.txt
	$(PIP) --no-compile -e '.[test]'
	-$(COMPILE)
	touch $(VENV)/.course $@

## Start JupyterLab on notebooks/ (prints the URL; opens no browser)
lab: $(VENV)/.course
	cd notebooks && ../$(BIN)/jupyter lab --no-browser $(ROOT_FLAG)

## Lint, unit tests, every notebook under nbval (on this CPU and on an emulated other one), and in a browser;
## prints each phase's time. The unit tests, the two nbval runs and the browser go side by side: on 2 cores
## each spends much of its time waiting on its own processes, and together they finish sooner than one
## after another. The unit tests, which would finish first, run in a session of their own at niceness 2
## and yield the CPU to the notebooks' kernels (see tests/phases.py); nbval, which would finish a few
## minutes before nbval-other-cpu (one thread), at niceness 1.
test:
	@$(PYTHON) tests/phases.py install lint "unit:2 nbval:1 nbval-other-cpu browser"

install: $(VENV)/.test

lint: $(VENV)/.test
	$(BIN)/ruff check course_lib tests benchmarks notebooks solutions

unit: $(VENV)/.test
	$(BIN)/python -m pytest -q tests --ignore=tests/test_browser.py

# Skipped, with the reason shown (-rs), where chromium is missing: `apt-get install chromium`
# (.ci/run installs it). Screenshots land in screenshots/.
browser: $(VENV)/.test
	$(BIN)/python -m pytest -q -rs tests/test_browser.py

# Which notebooks nbval and nbval-other-cpu run (all by default): make nbval NOTEBOOKS=notebooks/06_power_iteration.ipynb
NOTEBOOKS ?= notebooks
nbval: $(VENV)/.test
	$(NBVAL) $(NOTEBOOKS)

# Another CPU, emulated on this one. The stored outputs come from one machine; an instructor's CI
# runs on another, whose kernels round differently. Three things pick the kernels: PyTorch's own
# vectorized ones (ATEN_CPU_CAPABILITY), MKL's code path for matrix products (MKL_ENABLE_INSTRUCTIONS,
# MKL_CBWR: COMPATIBLE is its most basic path) and the number of threads a reduction is split over.
CPU_DEFAULT := ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE
CPU_AVX2    := ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 MKL_CBWR=AVX2
CPU_AVX512  := ATEN_CPU_CAPABILITY=avx512
ONE_THREAD  := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

## nbval once more, as another CPU would run it, with one thread: on an AVX-512 machine its AVX2 kernels
## (a student's laptop; where a course's stored outputs most often flip, as one compared claim once did
## between AVX-512 and AVX2), elsewhere the most basic ones, a set no machine runs by default.
## `make portability` runs every set. On a copy of the notebooks (and of what they read), so that it can
## run beside `make nbval`: the notebooks write the students' files (my_*.py) next to themselves.
OTHER_CPU_DIR ?= build/other-cpu
nbval-other-cpu: $(VENV)/.test
	rm -rf $(OTHER_CPU_DIR) && mkdir -p $(OTHER_CPU_DIR)/benchmarks
	cp -r notebooks img $(OTHER_CPU_DIR)/ && cp -r benchmarks/results $(OTHER_CPU_DIR)/benchmarks/
	rm -f $(OTHER_CPU_DIR)/notebooks/my_*.py
	@cap=$$($(BIN)/python -c "import torch; print(torch.backends.cpu.get_cpu_capability())"); \
	case $$cap in AVX512) other="$(CPU_AVX2)";; *) other="$(CPU_DEFAULT)";; esac; \
	echo "== this CPU runs $$cap kernels; nbval as another CPU: $$other $(ONE_THREAD)"; \
	cd $(OTHER_CPU_DIR) && env $$other $(ONE_THREAD) $(abspath $(BIN))/python -m pytest --nbval \
		--nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg --durations=8 $(NOTEBOOKS)

## nbval under every kernel set this CPU can emulate, and with one thread; says which failed
portability: $(VENV)/.test
	@cap=$$($(BIN)/python -c "import torch; print(torch.backends.cpu.get_cpu_capability())"); \
	failed=""; \
	run() { echo "== nbval with $$*"; env "$$@" $(NBVAL) -q notebooks || failed="$$failed [$$*]"; }; \
	run $(CPU_DEFAULT); \
	case $$cap in AVX2|AVX512) run $(CPU_AVX2);; *) echo "== no AVX2 on this CPU ($$cap): avx2 not run";; esac; \
	case $$cap in AVX512) run $(CPU_AVX512);; *) echo "== no AVX-512 on this CPU ($$cap): avx512 not run";; esac; \
	run $(ONE_THREAD); \
	if [ -n "$$failed" ]; then echo "portability: nbval failed with$$failed"; exit 1; fi; \
	echo "portability: nbval passed under every kernel set ($$cap CPU)"

## Re-execute every notebook in place (after changing course_lib or a notebook)
notebooks: $(VENV)/.test
	cd notebooks && for nb in *.ipynb; do \
		../$(BIN)/jupyter nbconvert --to notebook --execute --inplace "$$nb" || exit 1; done

## Redraw the diagrams in img/ from course_lib/notebooks/figures.py
figures: $(VENV)/.course
	$(BIN)/python -m course_lib.notebooks.figures img

clean:
	rm -rf $(VENV) *.egg-info
