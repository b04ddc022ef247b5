# shellcheck shell=bash
# bench/lib.sh: what bench/instructions, bench/syscalls and bench/spread
# share (sourced after scripts/lib.sh): free ports, and nginx as the static
# upstream of bench/run.

# The first port from $1 up that nothing listens on.
free_port() {
    local p=$1
    while port_in_use "$p"; do p=$((p + 1)); done
    echo "$p"
}

# The answer of bench/run's static upstream (its UPSTREAM_BODY): a fixed
# 201 with a 193-byte JSON body, the shape and size of the sample
# upstream's.
STATIC_ANSWER='{"execution":1,"key_executions":1,"key":"bench","attempt":"1","method":"POST","path":"/v1/orders","body_sha256":"44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a","body_len":95}'

# An nginx server block on 127.0.0.1:$1 giving STATIC_ANSWER to every request.
static_upstream_server() {
    cat <<CONF
    server {
        listen 127.0.0.1:$1;
        location / {
            default_type application/json;
            return 201 '$STATIC_ANSWER';
        }
    }
CONF
}

# Writes $1/$2.conf: nginx in the foreground with $3 worker processes, its
# pid ($1/$2.pid), error log ($1/$2-error.log) and temporary files under
# $1, no access log, unlimited keep-alive requests, and the server blocks $4.
# Start it with: nginx -p DIR -c DIR/NAME.conf -e DIR/NAME-error.log
nginx_conf() {
    local dir=$1 name=$2 workers=$3 servers=$4
    cat >"$dir/$name.conf" <<CONF
worker_processes $workers;
pid $dir/$name.pid;
error_log $dir/$name-error.log warn;
daemon off;
events { worker_connections 1024; }
http {
    access_log off;
    client_body_temp_path $dir/body;
    proxy_temp_path $dir/proxy;
    fastcgi_temp_path $dir/fastcgi;
    uwsgi_temp_path $dir/uwsgi;
    scgi_temp_path $dir/scgi;
    keepalive_requests 1000000000;
    keepalive_timeout 75s;
$servers
}
CONF
}
