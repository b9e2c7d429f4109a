#!/bin/busybox sh
# /init of the testbed's initramfs (busybox-static): the DMA traffic phases, each recorded by iommulab's own
# capture script (/capture.sh, as `iommulab capture --print-script` prints it), and the files `iommulab inspect`
# reads, saved as a tree. Everything goes to the results disk (serial tbout) as a tar.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null
mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null   # the capture's swiotlb notes read it
mkdir -p /tmp && mount -t tmpfs tmpfs /tmp
arg() { v=$(tr ' ' '\n' < /proc/cmdline | sed -n "s/^tb\.$1=//p" | tail -1); echo "${v:-$2}"; }
PHASES=$(arg phases net,blk)
NETMB=$(arg netmb 16)
TXMB=$(arg txmb 16)
BLKMB=$(arg blkmb 64)
PORT=$(arg port 8080)
# tb.domains=1: the capture also records each event's domain (kprobes: capture.sh -k).
K=; [ "$(arg domains 0)" = 1 ] && K=-k
# tb.devices=1: and the DMA API's events, which name each mapping's device (capture.sh -D, Linux 6.12+).
[ "$(arg devices 0)" = 1 ] && K="$K -D"
# tb.timer=1: and when the flush queue's timer fires (capture.sh -t, a kprobe on fq_flush_timeout).
[ "$(arg timer 0)" = 1 ] && K="$K -t"
# tb.measure=1: the capture records only the latencies of the DMA map/unmap path (capture.sh -M, for
# `iommulab profile measure --trace`), in place of the domains, devices and timer.
[ "$(arg measure 0)" = 1 ] && K=-M
say() { echo "TB: $*" > /dev/console; }
# tb.probes=SYM,SYM: a kprobe on each kernel function, recorded with the capture (a diagnostic; tb.timer
# already records fq_flush_timeout): enabled in the capture's own tracing instance by each captured command.
DIAG=
for s in $(arg probes "" | tr ',' ' '); do
  echo "p:tbdiag/$s $s" >> /sys/kernel/tracing/kprobe_events || { say "no kprobe on $s"; continue; }
  DIAG="$DIAG echo 1 > \$IOMMULAB_TRACE_INSTANCE/events/tbdiag/$s/enable;"
done
O=/tmp/out; mkdir -p $O
TM='$IOMMULAB_TRACE_MARKER'
# swiotlb's high-water mark (6.4+; only 0 may be written) is reset before each capture, so that the capture's
# end note gives that capture's own.
HW=/sys/kernel/debug/swiotlb/io_tlb_used_hiwater
hiwater0() { [ -e $HW ] && echo 0 > $HW; }
# The drivers' probe and the network's bring-up (virtio-net fills its RX ring as the link goes up).
cat > /tmp/probe.sh <<'EOF'
for m in $(cat /modules.list); do insmod /lib/modules/$m 2>/dev/null || echo "TB: insmod $m failed" > /dev/console; done
sleep 1
ip link set lo up
NETIF=$(ls /sys/class/net | grep -v '^lo$' | head -1)
if [ -n "$NETIF" ]; then
  ip link set "$NETIF" up; ip addr add 10.0.2.15/24 dev "$NETIF"; ip route add default via 10.0.2.2
fi
EOF
# tb.probe=1: these run inside a capture phase of their own (probe: first in trace.txt, no QEMU marks), so that
# every DMA mapping since the drivers probed is in the trace (what swiotlb's pool holds as each phase starts).
if [ "$(arg probe 0)" = 1 ]; then
  hiwater0
  sh /capture.sh -o $O/trace-probe.txt $K -- sh -c "$DIAG echo 'TB_BEGIN probe' > $TM; sh /tmp/probe.sh; sleep 1; echo 'TB_END probe' > $TM"
  say "phase probe done rc=$?"
else
  sh /tmp/probe.sh
fi
NETIF=$(ls /sys/class/net | grep -v '^lo$' | head -1)
OUTDEV= DATADEV=
for b in /sys/block/vd*; do
  s=$(cat $b/serial 2>/dev/null)
  [ "$s" = tbout ] && OUTDEV=/dev/${b##*/}
  [ "$s" = tbdata ] && DATADEV=/dev/${b##*/}
done
NVMEDEV=$(ls /dev/nvme*n1 2>/dev/null | head -1)
say "netif=$NETIF datadev=$DATADEV nvmedev=$NVMEDEV outdev=$OUTDEV"
# tb.blkmaxkb=KB: the data disk's largest request (max_sectors_kb; the phases' 1 MiB reads become several
# requests, each mapped on its own).
BLKMAXKB=$(arg blkmaxkb "")
[ -n "$BLKMAXKB" ] && [ -n "$DATADEV" ] && { echo "$BLKMAXKB" > /sys/block/${DATADEV#/dev/}/queue/max_sectors_kb \
  || say "max_sectors_kb $BLKMAXKB refused"; }
# A 4 KiB read of the results disk (no IOMMU) that QEMU traces: the phase edges on QEMU's clock.
declare_mark() { echo "mark() { dd if=$OUTDEV of=/dev/null bs=4096 count=1 skip=\$1 iflag=direct 2>/dev/null; };"; }
# The trace's phase markers sit right after QEMU's start mark and right before its end mark, so the two views
# cover the same window (a stray packet's RX refill at a phase's edge otherwise falls in one view only). They go
# to the capture's own instance: the captured command finds its trace_marker in $IOMMULAB_TRACE_MARKER.
# The marker reads run inside each captured command: QEMU's window lies within the trace's phase.
i=-1
for p in $(echo "$PHASES" | tr ',' ' '); do
  i=$((i + 1))   # phase i's marks are 40000 + 2i and 40001 + 2i, whether it runs or not
  case $p in
    net) work="wget -q -O /dev/null http://10.0.2.2:$PORT/blob$NETMB" ;;
    blk) work="dd if=$DATADEV of=/dev/null bs=1M count=$BLKMB iflag=direct" ;;
    nvme) [ -n "$NVMEDEV" ] || continue; work="dd if=$NVMEDEV of=/dev/null bs=1M count=$BLKMB iflag=direct" ;;
    # The guest sends TXMB MiB to the host (an HTTP POST boot.py's handler reads, counts and discards). The
    # file is made here, before the capture, in tmpfs (no DMA). Not of NULs: busybox wget (1.35) sends a
    # --post-file as a C string (Content-Length is its strlen), so /dev/zero's bytes would send nothing; they
    # become 'x's. A failed upload says so on the console (the phase's rc is its end mark's).
    tx) head -c $((TXMB << 20)) /dev/zero | tr '\0' x > /tmp/tx.bin
        work="wget -q --post-file /tmp/tx.bin -O /dev/null http://10.0.2.2:$PORT/upload/tx || echo 'TB: tx upload failed' > /dev/console" ;;
    # Every device at once (and the NVMe drive where the machine has one), each in its own domain with its
    # own flush queue.
    mix) work="wget -q -O /dev/null http://10.0.2.2:$PORT/blob$NETMB & dd if=$DATADEV of=/dev/null bs=1M count=$BLKMB iflag=direct"
         [ -n "$NVMEDEV" ] && work="$work & dd if=$NVMEDEV of=/dev/null bs=1M count=$BLKMB iflag=direct"
         work="$work; wait" ;;
    *) continue ;;
  esac
  # Each phase ends 1 s after its traffic, so lazy mode's flush timers fire inside it, in both views.
  hiwater0
  sh /capture.sh -o $O/trace-$p.txt $K -- sh -c "$DIAG $(declare_mark) mark $((40000 + 2 * i)); echo 'TB_BEGIN $p' > $TM; $work; sleep 1; echo 'TB_END $p' > $TM; mark $((40001 + 2 * i))"
  say "phase $p done rc=$?"
  rm -f /tmp/tx.bin
done
for p in probe $(echo "$PHASES" | tr ',' ' '); do cat $O/trace-$p.txt; done > $O/trace.txt 2>/dev/null
# What `iommulab inspect` reads, as a tree (sysfs links to directories become directories).
R=$O/root
save() { for f in "$@"; do [ -e "$f" ] || continue; mkdir -p "$R${f%/*}"; cat "$f" > "$R$f" 2>/dev/null; done; }
save /proc/cmdline /proc/sys/kernel/osrelease /proc/sys/kernel/arch
for g in /sys/kernel/iommu_groups/*; do
  [ -e "$g" ] || continue   # no groups: the glob stays as it is
  save $g/type
  for d in $g/devices/*; do
    b=${d##*/}; mkdir -p "$R$g/devices/$b"
    save /sys/bus/pci/devices/$b/class
    l=$(readlink /sys/bus/pci/devices/$b/driver 2>/dev/null) && mkdir -p "$R/sys/bus/pci/devices/$b" \
      && ln -s "$l" "$R/sys/bus/pci/devices/$b/driver"
  done
done
for i in /sys/class/iommu/*; do [ -e "$i" ] && mkdir -p "$R$i" && save $i/intel-iommu/cap $i/intel-iommu/ecap $i/amd-iommu/cap $i/amd-iommu/features; done
dmesg > $O/dmesg.txt
mkdir -p $R/dev && cp $O/dmesg.txt $R/dev/kmsg   # inspect reads a saved tree's kernel log as dmesg prints it
(cd $O && tar -cf $OUTDEV trace.txt dmesg.txt root) && sync && say "wrote results"
say "TB_DONE"
poweroff -f
