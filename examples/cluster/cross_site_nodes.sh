#!/usr/bin/env bash
# Cross-site FL+HSDP over Flower: one SuperLink (site A), one node per site (one group each).
# Site A:   flower-superlink --ssl-ca-certfile ca.crt --ssl-certfile server.pem \
#             --ssl-keyfile server.key --disable-runtime-dependency-installation \
#             --host 0.0.0.0 --port 8000      # Flower listens on 127.0.0.1 only by default
# Each site (one host, 8 GPUs; the group's ranks talk over NVLink, only weights cross sites):
flower-shard node --superlink superlink.example.org:8000 --root-certificates certs/ca.crt \
  --nproc-per-group 8 --device cuda --data /path/to/site/text
# Then, from anywhere with the connection in $FLWR_HOME/config.toml (examples/config.toml):
#   flwr run . cross-site --run-config "transport='flower' sharding='hsdp' replicate=2 \
#       model='llama3.1-8b' bf16=true local-steps=8 num-server-rounds=500 min-groups=2"
