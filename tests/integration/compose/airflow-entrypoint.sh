#!/bin/bash
# What docker-compose.yaml asks of apache/airflow's /entrypoint: migrate the database and
# create the UI user when told to, then run `airflow <command>` (or bash/python/airflow as given).
set -euo pipefail
if [[ "${_AIRFLOW_DB_MIGRATE:-}" == "true" ]]; then
    airflow db migrate
fi
if [[ "${_AIRFLOW_WWW_USER_CREATE:-}" == "true" ]]; then
    airflow users create --role Admin --firstname Airflow --lastname Admin --email airflow@example.com \
        --username "${_AIRFLOW_WWW_USER_USERNAME:-airflow}" --password "${_AIRFLOW_WWW_USER_PASSWORD:-airflow}" \
        || true  # exists already
fi
case "${1:-}" in
    bash | python | airflow) exec "$@" ;;
    *) exec airflow "$@" ;;
esac
