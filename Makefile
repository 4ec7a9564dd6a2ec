# The course's two commands: `make lab` and `make test`. Everything else serves them.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip install --disable-pip-version-check -q -c constraints.txt
NBVAL  := $(BIN)/python -m pytest --nbval --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg
# JupyterLab refuses to run as root unless told; containers often run as root.
ROOT_FLAG := $(shell [ "$$(id -u)" = 0 ] && echo --allow-root)

.PHONY: lab test lint unit nbval browser notebooks figures clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.course: $(BIN)/python pyproject.toml constraints.txt
	$(PIP) -e .
	touch $@

$(VENV)/.test: $(VENV)/.course
	$(PIP) -e '.[test]'
	touch $@

## Start JupyterLab on notebooks/ (prints the URL; opens no browser)
lab: $(VENV)/.course
	cd notebooks && ../$(BIN)/jupyter lab --no-browser $(ROOT_FLAG)

## Lint, unit tests, every notebook under nbval, and every notebook in JupyterLab in a browser
test: lint unit nbval browser

lint: $(VENV)/.test
	$(BIN)/ruff check course_lib tests benchmarks notebooks

unit: $(VENV)/.test
	$(BIN)/python -m pytest -q tests --ignore=tests/test_browser.py

# Skipped, with the reason shown (-rs), where chromium is missing: `apt-get install chromium`
# (.ci/run installs it). Screenshots land in screenshots/.
browser: $(VENV)/.test
	$(BIN)/python -m pytest -q -rs tests/test_browser.py

nbval: $(VENV)/.test
	$(NBVAL) notebooks

## Re-execute every notebook in place (after changing course_lib or a notebook)
notebooks: $(VENV)/.test
	cd notebooks && for nb in *.ipynb; do \
		../$(BIN)/jupyter nbconvert --to notebook --execute --inplace "$$nb" || exit 1; done

## Redraw the diagrams in img/ from course_lib/figures.py
figures: $(VENV)/.course
	$(BIN)/python -m course_lib.figures img

clean:
	rm -rf $(VENV) *.egg-info
