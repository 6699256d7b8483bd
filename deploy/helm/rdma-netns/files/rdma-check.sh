# JOB_COMPLETION_INDEX (set by the Job): 0 serves, 1 connects to $PEER.
set -u
hca=$(sed -n 's/^NCCL_IB_HCA==\{0,1\}//p' /etc/nccl.conf)
gid_index=$(sed -n 's/^NCCL_IB_GID_INDEX=//p' /etc/nccl.conf)
if [ -z "$hca" ] || [ -z "$gid_index" ]; then
  echo "no NCCL_IB_HCA / NCCL_IB_GID_INDEX in /etc/nccl.conf: is the pod granted rdma/hca, CDI on?"
  exit 1
fi
rail=0
for device_port in $(echo "$hca" | sed 's/,/ /g'); do
  device=${device_port%%:*}
  port=$((FIRST_PORT + rail))
  if [ "$JOB_COMPLETION_INDEX" = 0 ]; then
    echo "rail $rail: serving on $device, GID index $gid_index, port $port"
    ib_write_bw -d "$device" -x "$gid_index" -s 65536 -n 1000 -p "$port" --report_gbits || exit 1
  else
    # The server may not listen yet: retry while the TCP connection is refused.
    tries=0
    until out=$(ib_write_bw -d "$device" -x "$gid_index" -s 65536 -n 1000 -p "$port" \
                  --report_gbits "$PEER" 2>&1); do
      tries=$((tries + 1))
      case $out in
        *"Couldn't connect to"*) [ "$tries" -lt 150 ] && { sleep 2; continue; } ;;
      esac
      echo "rail $rail ($device, GID index $gid_index): FAILED"; echo "$out"; exit 1
    done
    echo "rail $rail ($device, GID index $gid_index) -> $PEER:$port:"; echo "$out"
  fi
  rail=$((rail + 1))
done
