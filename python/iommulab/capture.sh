#!/bin/sh
# iommulab capture: record the kernel's iommu:map / iommu:unmap tracepoints (and iommu:io_page_fault where the
# kernel has it) through tracefs into a trace `iommulab replay` reads as it is. POSIX sh: runs on a minimal guest
# or a busybox initramfs, where Python is not installed (`iommulab capture --print-script` prints this file).
#
#   capture.sh -o TRACE [-d SECONDS] [-p PHASE] [-b KB] [-k] [-D] [-t] [-n] [-- COMMAND [ARG...]]
#
#   -o TRACE    output file; TRACE.xz is compressed with xz, TRACE.gz with gzip, anything else is plain text
#   -d SECONDS  record for this long (default: until COMMAND ends, or 10 s without one)
#   -p PHASE    bracket the recording with TB_BEGIN PHASE / TB_END PHASE markers (replay reports per phase)
#   -b KB       per-CPU ring buffer size while recording (default 65536)
#   -k          also record each map's and unmap's domain (kprobes on __iommu_map or iommu_map_nosync, and
#               __iommu_unmap), where the kernel allows kprobes; replay can then tell devices' domains apart.
#               Without kprobes, the DMA API's own events (as -D) where the kernel has them
#   -D          also record the DMA API's events (dma:dma_map_page or dma_map_phys, dma_map_sg, ..., Linux 6.12
#               and later), which name each mapping's device, and the IOMMU groups as comment lines
#   -t          also record when the flush queue's timer fires (a kprobe on fq_flush_timeout) and whose domain
#               it flushes (a kprobe on the IOMMU driver's flush_iotlb_all), where the kernel allows it; replay
#               then runs each domain's lazy flush timer as it ran
#   -n          dry run: print what would be done, change nothing
#
# It saves the tracing state it touches (buffer size, the events it enables, kprobe events it adds, tracing_on)
# and restores it on exit, Ctrl-C included; the events read so far are kept. When recording stops, it waits
# (up to a minute) for its reader to drain the ring buffer. Events the ring buffer dropped (overruns) and events
# left unread are counted from per_cpu/*/stats and reported, and written as comment lines into the trace.
set -u

out= dur= phase= bufkb=65536 kprobes=0 dmaev=0 timerprobe=0 dry=0 timer=0
while [ $# -gt 0 ]; do
  case "$1" in
    -o) out=${2-}; shift 2 ;;
    -d) dur=${2-}; shift 2 ;;
    -p) phase=${2-}; shift 2 ;;
    -b) bufkb=${2-}; shift 2 ;;
    -k) kprobes=1; shift ;;
    -D) dmaev=1; shift ;;
    -t) timerprobe=1; shift ;;
    -n) dry=1; shift ;;
    --) shift; break ;;
    *) echo "capture: unknown option $1 (see the header of this script)" >&2; exit 2 ;;
  esac
done
[ -n "$out" ] || { echo "capture: -o TRACE is required" >&2; exit 2; }
case "$bufkb" in ''|*[!0-9]*) echo "capture: -b $bufkb: expected a size in KiB" >&2; exit 2 ;; esac
case "$dur" in ''|*[!0-9.]*) [ -z "$dur" ] || { echo "capture: -d $dur: expected seconds" >&2; exit 2; } ;; esac
case "$phase" in *[!A-Za-z0-9_.-]*) echo "capture: -p $phase: expected one word" >&2; exit 2 ;; esac

T=${IOMMULAB_TRACEFS-}  # another tracefs (tests)
[ -n "$T" ] || for d in /sys/kernel/tracing /sys/kernel/debug/tracing; do
  [ -e "$d/trace_marker" ] && { T=$d; break; }
done
[ -n "$T" ] && [ -e "$T/trace_marker" ] || {
  echo "capture: no tracefs (mount -t tracefs nodev /sys/kernel/tracing)" >&2; exit 2; }
[ -d "$T/events/iommu/map" ] || { echo "capture: this kernel has no iommu:map tracepoint" >&2; exit 2; }
if [ "$dry" = 0 ] && [ ! -w "$T/trace_marker" ]; then
  echo "capture: needs root (writing $T)" >&2; exit 2
fi
case "$out" in
  *.xz) command -v xz >/dev/null 2>&1 || { echo "capture: -o $out: no xz here; use .gz or plain" >&2; exit 2; } ;;
  *.gz) command -v gzip >/dev/null 2>&1 || { echo "capture: -o $out: no gzip here; use plain" >&2; exit 2; } ;;
esac
[ -e "$out" ] && { echo "capture: -o $out: exists (nothing is overwritten)" >&2; exit 2; }

events="iommu/map iommu/unmap"
[ -d "$T/events/iommu/io_page_fault" ] && events="$events iommu/io_page_fault"
# The DMA API's calls that map or unmap (kernel/dma/mapping.c), each naming its device.
dma_events=
# (dma_map_phys and dma_unmap_phys replace dma_map_page/dma_unmap_page and the resource pair in newer kernels.)
for e in dma_map_page dma_unmap_page dma_map_phys dma_unmap_phys dma_map_resource dma_unmap_resource dma_map_sg \
         dma_unmap_sg dma_alloc dma_free dma_alloc_pages dma_free_pages dma_alloc_sgt dma_free_sgt; do
  [ -d "$T/events/dma/$e" ] && dma_events="$dma_events dma/$e"
done
# The function every IOMMU map goes through, with the domain, IOVA and size as its 1st, 2nd and 4th arguments:
# __iommu_map(), renamed iommu_map_nosync() in newer kernels.
mapfn=
for f in __iommu_map iommu_map_nosync; do
  grep -q " $f\$" /proc/kallsyms 2>/dev/null && { mapfn=$f; break; }
done
if [ "$kprobes" = 1 ] && { [ ! -w "$T/kprobe_events" ] || [ -z "$mapfn" ]; }; then
  kprobes=0
  if [ -n "$dma_events" ]; then
    dmaev=1
    echo "capture: no kprobes here (kprobe_events not writable or neither __iommu_map nor iommu_map_nosync in kallsyms): the DMA API's events name each mapping's device instead" >&2
  else
    echo "capture: no kprobes here (kprobe_events not writable or neither __iommu_map nor iommu_map_nosync in kallsyms) and no DMA API events (Linux 6.12+): the trace will not name domains" >&2
  fi
fi
if [ "$dmaev" = 1 ]; then
  [ -n "$dma_events" ] || echo "capture: this kernel has no DMA API events (dma:dma_map_page, Linux 6.12+): the trace will not name devices" >&2
  events="$events$dma_events"
fi

ksym() {  # a kernel function in kallsyms, built in or in a loaded module ("NAME\t[module]")
  grep -qE " $1([[:space:]]|\$)" /proc/kallsyms 2>/dev/null
}

run() {  # run or, with -n, print a change to tracefs
  if [ "$dry" = 1 ]; then echo "would: $*"; else sh -c "$*"; fi
}

if [ "$dry" = 1 ]; then
  echo "tracefs: $T"
  echo "would save: buffer_size_kb=$(cat $T/buffer_size_kb) tracing_on=$(cat $T/tracing_on)"
fi
old_buf=$(cat "$T/buffer_size_kb")
# A ring buffer not used since boot reads "7 (expanded: 1408)": 1408 KiB is its size.
case "$old_buf" in *"expanded: "*) old_buf=${old_buf##*expanded: }; old_buf=${old_buf%%)*} ;; esac
old_on=$(cat "$T/tracing_on")
old_ev=
for e in $events; do old_ev="$old_ev $e=$(cat "$T/events/$e/enable")"; done
added_kprobes=

restore() {
  run "echo 0 > $T/tracing_on"
  for pair in $old_ev; do run "echo ${pair#*=} > $T/events/${pair%%=*}/enable"; done
  for k in $added_kprobes; do
    run "echo 0 > $T/events/iommulab/$k/enable"
    run "echo -:iommulab/$k >> $T/kprobe_events"
  done
  run "echo $old_buf > $T/buffer_size_kb"
  run "echo $old_on > $T/tracing_on"
}

tmp=${out%.xz}
tmp=${tmp%.gz}.part
stopped=0
trap 'stopped=1' INT TERM

run "echo 0 > $T/tracing_on"
run "echo > $T/trace"
run "echo $bufkb > $T/buffer_size_kb"
for e in $events; do run "echo 1 > $T/events/$e/enable"; done
if [ "$kprobes" = 1 ]; then
  # The testbed's probes: the domain pointer, IOVA and size of every __iommu_map (or iommu_map_nosync) and
  # __iommu_unmap.
  run "echo 'p:iommulab/tb_map $mapfn dom=\$arg1:x64 iova=\$arg2:x64 size=\$arg4:u64' >> $T/kprobe_events" \
    && run "echo 1 > $T/events/iommulab/tb_map/enable" && added_kprobes="$added_kprobes tb_map"
  run "echo 'p:iommulab/tb_unmap __iommu_unmap dom=\$arg1:x64 iova=\$arg2:x64 size=\$arg3:u64' >> $T/kprobe_events" \
    && run "echo 1 > $T/events/iommulab/tb_unmap/enable" && added_kprobes="$added_kprobes tb_unmap"
  # The DMA API's IOVA interface (6.17+: nvme-pci's data): dma_iova_unlink() syncs the IOTLB at once, in a lazy
  # domain too; replay takes the unmap that follows on the CPU as such.
  if ksym dma_iova_unlink; then
    run "echo 'p:iommulab/tb_iova_unlink dma_iova_unlink' >> $T/kprobe_events" \
      && run "echo 1 > $T/events/iommulab/tb_iova_unlink/enable" && added_kprobes="$added_kprobes tb_iova_unlink"
  fi
fi
if [ "$timerprobe" = 1 ]; then
  # dma-iommu.c's flush-queue timer callback (lazy mode): when the timer really fired.
  # Its domain: the cookie's fq_domain, past the timer (fq_timer, fq_timer_on) in struct iommu_dma_cookie: 64
  # bytes on Linux 6.1-6.14 without lockdep (msi_page_list lies between; read right on 6.1 and 6.12), 48 from 6.15 on (commit 6aa63a4ec947,
  # "iommu: Sort out domain user data", moved it out of the union).
  fqoff=64
  kv=$(uname -r 2>/dev/null); kmaj=${kv%%.*}; kmin=${kv#*.}; kmin=${kmin%%[!0-9]*}
  case "$kmaj$kmin" in *[!0-9]*|'') ;; *) { [ "$kmaj" -gt 6 ] || { [ "$kmaj" -eq 6 ] && [ "${kmin:-0}" -ge 15 ]; }; } && fqoff=48 ;; esac
  if [ -w "$T/kprobe_events" ] && grep -q ' fq_flush_timeout$' /proc/kallsyms 2>/dev/null \
     && run "echo 'p:iommulab/fq_flush_timeout fq_flush_timeout fq_domain=+$fqoff(\$arg1):x64' >> $T/kprobe_events" \
     && run "echo 1 > $T/events/iommulab/fq_flush_timeout/enable"; then
    added_kprobes="$added_kprobes fq_flush_timeout"
    timer=1
    # Replay checks the fq_domain read against the domains the trace names. And the flush it makes, where the
    # driver's flush_iotlb_all(domain) can be probed: fq_flush_iotlb() calls it on the same CPU. Every
    # driver built in is probed (an x86 kernel has VT-d's and AMD's even where virtio-iommu serves the
    # devices); only the one in use fires.
    for f in intel_flush_iotlb_all arm_smmu_flush_iotlb_all amd_iommu_flush_iotlb_all viommu_flush_iotlb_all; do
      ksym "$f" || continue
      k=tb_flush_all_${f%_flush_iotlb_all}
      run "echo 'p:iommulab/$k $f dom=\$arg1:x64' >> $T/kprobe_events" \
        && run "echo 1 > $T/events/iommulab/$k/enable" \
        && added_kprobes="$added_kprobes $k" && timer=2
    done
  else
    echo "capture: no kprobe on fq_flush_timeout here: the trace will not record the flush queue's timer" >&2
  fi
fi

if [ "$dry" = 1 ]; then
  echo "would record to $out${phase:+ with markers TB_BEGIN/TB_END $phase}${dur:+ for $dur s}${1:+ while running: $*}"
  restore
  exit 0
fi

: > "$tmp" || { echo "capture: cannot write $tmp" >&2; restore; exit 2; }
[ "$timer" != 0 ] && echo "# iommulab capture: flush queue timer recorded (kprobe fq_flush_timeout)" > "$tmp"
[ "$timer" = 2 ] && echo "# iommulab capture: flush queue timer's domain recorded (kprobe tb_flush_all)" >> "$tmp"
# With the DMA API's events, which devices share a domain: their IOMMU group.
if [ "$dmaev" = 1 ] && [ -n "$dma_events" ]; then
  for g in /sys/kernel/iommu_groups/*; do
    [ -d "$g/devices" ] && echo "# iommulab capture: iommu group ${g##*/}: $(ls "$g/devices" | tr '\n' ' ')" >> "$tmp"
  done
fi
cat "$T/trace_pipe" >> "$tmp" &
reader=$!
echo 1 > "$T/tracing_on"
[ -n "$phase" ] && echo "TB_BEGIN $phase" > "$T/trace_marker"
status=0
if [ $# -gt 0 ]; then
  "$@" & child=$!
  while kill -0 "$child" 2>/dev/null && [ "$stopped" = 0 ]; do sleep 1; done
  [ "$stopped" = 1 ] && kill "$child" 2>/dev/null
  wait "$child" 2>/dev/null; status=$?
else
  left=${dur:-10}
  left=${left%.*}
  while [ "${left:-0}" -gt 0 ] && [ "$stopped" = 0 ]; do sleep 1; left=$((left - 1)); done
fi
[ -n "$phase" ] && echo "TB_END $phase" > "$T/trace_marker"
echo 0 > "$T/tracing_on"
# A per-CPU stats field summed over CPUs: overrun (events overwritten before they were read), entries (events
# still in the ring buffer, not yet read).
stat_sum() {
  stat_total=0
  for s in "$T"/per_cpu/cpu*/stats; do
    n=$(sed -n "s/^$1: *//p" "$s" 2>/dev/null)
    stat_total=$((stat_total + ${n:-0}))
  done
  echo "$stat_total"
}
# The reader lags behind a busy recording (a slow guest formats events slowly): let it drain the ring buffer
# before stopping it, up to a minute, then a second more to write out its last read.
left=60
while [ "$(stat_sum entries)" -gt 0 ] && [ "$left" -gt 0 ] && [ "$stopped" = 0 ] && kill -0 "$reader" 2>/dev/null; do
  sleep 1; left=$((left - 1))
done
sleep 1
kill "$reader" 2>/dev/null
wait "$reader" 2>/dev/null
lost=$(stat_sum overrun)
unread=$(stat_sum entries)
[ "$lost" -gt 0 ] && echo "# iommulab capture: $lost events lost to ring-buffer overruns (raise -b)" >> "$tmp"
[ "$unread" -gt 0 ] && echo "# iommulab capture: $unread events lost: recorded, not read before the reader stopped" >> "$tmp"
restore
case "$out" in
  *.xz) xz -c "$tmp" > "$out" && rm -f "$tmp" ;;
  *.gz) gzip -c "$tmp" > "$out" && rm -f "$tmp" ;;
  *) mv "$tmp" "$out" ;;
esac
lostmsg=
[ "$lost" -gt 0 ] && lostmsg="; $lost events were lost to ring-buffer overruns (raise -b)"
[ "$unread" -gt 0 ] && lostmsg="$lostmsg; $unread events were recorded but not read before the reader stopped"
echo "capture: wrote $out${lostmsg:-; no events lost}" >&2
[ "$stopped" = 1 ] && echo "capture: interrupted; the events read so far are kept" >&2
exit "$status"
