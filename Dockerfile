# selection-proto in a container: one instance, its snapshot on a volume (deploy/kubernetes/).
# tests/test_deploy.py runs this file's RUN steps, ENTRYPOINT/CMD and HEALTHCHECK as a script.
FROM python:3.11-slim

RUN useradd --create-home --uid 10001 selector
WORKDIR /app
COPY pyproject.toml README.md LICENSE ./
COPY selection_proto ./selection_proto
RUN pip install --no-cache-dir '.[gateway]'

USER 10001
# Listen on every interface inside the image; keep the state where a volume can hold it.
ENV SELECTION_PROTO_HOST=0.0.0.0 \
    SELECTION_PROTO_PORT=8092 \
    SELECTION_PROTO_SNAPSHOT=/var/lib/selection-proto/state.json \
    SELECTION_PROTO_LOG_FORMAT=json
VOLUME /var/lib/selection-proto
# 9002: Envoy's ext_proc (the endpoint picker), when SELECTION_PROTO_EXT_PROC_PORT is set.
EXPOSE 8092 9002
HEALTHCHECK --interval=10s --timeout=3s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ['SELECTION_PROTO_PORT'], timeout=2)"
ENTRYPOINT ["selection-proto"]
CMD ["serve"]
