-- Run once by the postgres image when its data volume is empty
-- (/docker-entrypoint-initdb.d). One server, one database per service that keeps state
-- in Postgres; each service creates and migrates its own tables when it starts.
-- Stream recovery keeps its state in Redis and needs none.
CREATE DATABASE runplane_run_store;
CREATE DATABASE runplane_sandbox_reconciler;
CREATE DATABASE runplane_credential_health;
