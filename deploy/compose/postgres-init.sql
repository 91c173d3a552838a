-- Run once, when the data volume is empty, by deploy/images/postgres-entrypoint.sh
-- (psql, with the passwords as variables). One role and one database per service that
-- keeps state in Postgres: each service reaches only its own database, owns it, and
-- creates and migrates its own tables when it starts. Stream recovery keeps its state
-- in Redis and needs none.
CREATE ROLE run_store LOGIN PASSWORD :'run_store_password';
CREATE ROLE sandbox_reconciler LOGIN PASSWORD :'sandbox_reconciler_password';
CREATE ROLE credential_health LOGIN PASSWORD :'credential_health_password';
CREATE DATABASE runplane_run_store OWNER run_store;
CREATE DATABASE runplane_sandbox_reconciler OWNER sandbox_reconciler;
CREATE DATABASE runplane_credential_health OWNER credential_health;
-- Nobody else may connect to them.
REVOKE CONNECT, TEMPORARY ON DATABASE runplane_run_store FROM PUBLIC;
REVOKE CONNECT, TEMPORARY ON DATABASE runplane_sandbox_reconciler FROM PUBLIC;
REVOKE CONNECT, TEMPORARY ON DATABASE runplane_credential_health FROM PUBLIC;
