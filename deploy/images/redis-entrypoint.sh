#!/bin/sh
# Redis for runplane's compose stack: AUTH with REDIS_PASSWORD, appendonly in /data.
set -eu
[ -n "${REDIS_PASSWORD:-}" ] || { echo "runplane-redis: REDIS_PASSWORD is not set" >&2; exit 1; }
umask 077
conf=$(mktemp)
printf 'requirepass "%s"\n' "$REDIS_PASSWORD" > "$conf"
unset REDIS_PASSWORD
exec redis-server "$conf" --bind 0.0.0.0 --protected-mode no --dir /data \
  --appendonly yes --save ""
