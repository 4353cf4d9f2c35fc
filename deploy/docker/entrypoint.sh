#!/bin/sh
# The tokenserve image's entrypoint, with tensorflow/serving's habits:
#   docker run -e MODEL_NAME=m -v /host/m:/models/m tokenserve          # serves /models/m
#   docker run tokenserve --model_name=m --model_base_path=/models/m    # flags as given
#   docker run tokenserve --model_config_file=/models/models.config     # the file wins
#   docker run tokenserve tokenserve bench ...  |  docker run -it tokenserve sh
# With no MODEL_NAME it serves the built-in model exported at build time (/models/builtin).
# Flags after the image name come last, so they override the defaults below.
set -e
if [ "$#" -eq 0 ] || [ "${1#-}" != "$1" ]; then
    exec tokenserve serve \
        --port="${GRPC_PORT:-8500}" --rest_api_port="${REST_API_PORT:-8501}" \
        --openai_port="${OPENAI_PORT:-8000}" \
        --model_name="${MODEL_NAME:-builtin}" \
        --model_base_path="${MODEL_BASE_PATH:-/models}/${MODEL_NAME:-builtin}" \
        "$@"
fi
exec "$@"
