#!/bin/sh
# Runs once, when the postgres volume is first initialised (docker-entrypoint-initdb.d): the MLflow
# backend store gets its own database beside the Optuna one (POSTGRES_DB). Both keep an
# alembic_version table, so they cannot share one database.
set -eu
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
    -c "CREATE DATABASE \"${MLFLOW_DB:-mlflow}\" OWNER \"$POSTGRES_USER\""
