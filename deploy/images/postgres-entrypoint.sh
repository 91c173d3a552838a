#!/bin/sh
# PostgreSQL for runplane's compose stack. On first start (no cluster in $PGDATA): a
# cluster whose superuser `postgres` has POSTGRES_PASSWORD, reached over TCP by password
# only (SCRAM), and one role and database per service from postgres-init.sql, with
# RUN_STORE_DB_PASSWORD, SANDBOX_RECONCILER_DB_PASSWORD and CREDENTIAL_HEALTH_DB_PASSWORD.
# Then, every start: the server in the foreground.
set -eu
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  for var in POSTGRES_PASSWORD RUN_STORE_DB_PASSWORD SANDBOX_RECONCILER_DB_PASSWORD \
             CREDENTIAL_HEALTH_DB_PASSWORD; do
    eval "value=\${$var:-}"
    [ -n "$value" ] || { echo "runplane-postgres: $var is not set" >&2; exit 1; }
  done
  pwfile=$(mktemp)
  printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
  "$bin/initdb" -D "$PGDATA" -U postgres --pwfile="$pwfile" \
    --auth-local=peer --auth-host=scram-sha-256 >/dev/null
  rm -f "$pwfile"
  cat >> "$PGDATA/postgresql.conf" <<CONF
listen_addresses = '*'
unix_socket_directories = '/tmp'
password_encryption = 'scram-sha-256'
CONF
  cat >> "$PGDATA/pg_hba.conf" <<HBA
host all all 0.0.0.0/0 scram-sha-256
host all all ::/0 scram-sha-256
HBA
  "$bin/pg_ctl" -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
  psql -h /tmp -U postgres -d postgres -q -v ON_ERROR_STOP=1 \
    -v run_store_password="$RUN_STORE_DB_PASSWORD" \
    -v sandbox_reconciler_password="$SANDBOX_RECONCILER_DB_PASSWORD" \
    -v credential_health_password="$CREDENTIAL_HEALTH_DB_PASSWORD" \
    -f /etc/runplane/postgres-init.sql
  "$bin/pg_ctl" -D "$PGDATA" -m fast -w stop >/dev/null
fi
exec "$bin/postgres" -D "$PGDATA"
