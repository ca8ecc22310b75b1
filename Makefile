# Two commands do all the set-up on a fresh Debian 12 machine, as root:
#   make demo   -- kpr on its embedded default: a throwaway netns lab, real connections
#   make test   -- the test suite (unit tests, and real-kernel tests when root)
# Both run deploy/host-setup.sh first: apt packages, the kernel headers kpr ships
# (for BCC, on a kernel without its own), bpffs, and the venv at .venv with the `kpr` command. It is idempotent.

VENV := .venv
PYTHON := $(VENV)/bin/python

.PHONY: setup demo test lint scale clean

setup:
	sh deploy/host-setup.sh --venv $(VENV)

demo: setup
	$(VENV)/bin/kpr demo

test: setup lint
	command -v shellcheck >/dev/null && command -v ruby >/dev/null && command -v openssl >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends shellcheck ruby openssl; }
	# The real-node lab: containerd, runc and the CNI plugins on each node; buildah and
	# debootstrap build its images (no registry); busybox-static and libc6-dev go into them.
	dpkg -s containerd runc containernetworking-plugins buildah debootstrap busybox-static libc6-dev curl >/dev/null 2>&1 || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends containerd runc containernetworking-plugins buildah debootstrap busybox-static libc6-dev curl; }
	# The real Kubernetes components the lab tests run (cached outside the clone; without Go
	# it says so, and those tests skip with the reason). The lab (lab/) is not installed:
	# `-m` finds it in the working directory, the repository's root.
	$(PYTHON) -m lab.kube build --if-go
	$(PYTHON) -m pytest -q

# Style, the import layers (pyproject's [tool.importlinter]) and types ([tool.mypy]).
lint: setup
	$(VENV)/bin/ruff check kpr lab bench tests
	$(VENV)/bin/ruff format --check kpr lab bench tests
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

# The figures in README.md: 10,000 services x 10 endpoints (bench/scale.py, from the root).
scale: setup
	$(PYTHON) -m bench.scale --services 10000 --endpoints 10

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
