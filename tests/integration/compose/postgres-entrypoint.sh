#!/bin/bash
# What docker-compose.yaml asks of the postgres image: a server listening on every address,
# with POSTGRES_USER (password POSTGRES_PASSWORD) and POSTGRES_DB made on first start.
set -euo pipefail
PGDATA=/var/lib/postgresql/data
install -d -o postgres -g postgres -m 700 "$PGDATA"
install -d -o postgres -g postgres -m 2775 /var/run/postgresql
if [[ ! -s "$PGDATA/PG_VERSION" ]]; then
    printf '%s\n' "$POSTGRES_PASSWORD" > /tmp/pwfile && chown postgres /tmp/pwfile
    runuser -u postgres -- initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile=/tmp/pwfile \
        --encoding=UTF8 --locale=C.UTF-8 --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    rm /tmp/pwfile
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    runuser -u postgres -- pg_ctl -D "$PGDATA" -w -o "-c listen_addresses=''" start >/dev/null
    runuser -u postgres -- createdb -U "$POSTGRES_USER" "$POSTGRES_DB"
    runuser -u postgres -- pg_ctl -D "$PGDATA" -w stop >/dev/null
fi
exec runuser -u postgres -- postgres -D "$PGDATA" -c listen_addresses='*'
