#!/bin/bash
# prepare.sh DIR -- the testbed's host side, once: Debian packages (qemu-system-x86, busybox-static, cpio, kmod,
# xz-utils, zstd), Debian 12's default kernel (linux-image-amd64, downloaded and unpacked, never installed), and
# an initramfs of busybox, the virtio/NVMe modules, the guest init and iommulab's capture script. Needs root.
set -euo pipefail
HERE=$(dirname "$(readlink -f "$0")")
TB=$(readlink -f "${1:?usage: prepare.sh DIR}")
mkdir -p "$TB" && cd "$TB"
[ -s initrd.cpio.gz ] && [ -n "$(ls kroot/boot/vmlinuz-* 2>/dev/null)" ] && { echo "prepared: $TB"; exit 0; }
export DEBIAN_FRONTEND=noninteractive
command -v qemu-system-x86_64 >/dev/null && command -v busybox >/dev/null || {
  apt-get update -qq
  apt-get install -y -q --no-install-recommends qemu-system-x86 busybox-static cpio kmod xz-utils zstd >/dev/null
}
K=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-6/{print $2}' | head -1)
[ -n "$K" ] || { apt-get update -qq; K=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-6/{print $2}' | head -1); }
rm -rf kroot linux-image-*.deb
apt-get download "$K" >/dev/null
dpkg -x linux-image-*.deb kroot
KV=$(ls kroot/lib/modules | head -1)
depmod -b "$TB/kroot" "$KV"
W=$(mktemp -d)
mkdir -p "$W"/{bin,dev,proc,sys,tmp,lib/modules}
cp /bin/busybox "$W/bin/busybox"
cp "$HERE/guest-init.sh" "$W/init"; chmod +x "$W/init"
python3 -c "import importlib.resources as r; print(r.files('iommulab').joinpath('capture.sh').read_text(), end='')" \
  > "$W/capture.sh" 2>/dev/null || cp "$HERE/../python/iommulab/capture.sh" "$W/capture.sh"
: > "$W/modules.list"
for m in virtio_pci virtio_net virtio_blk; do
  modprobe -d "$TB/kroot" -S "$KV" --show-depends "$m" 2>/dev/null | awk '$1=="insmod"{print $2}' || true
done | awk '!seen[$0]++' | while read -r f; do
  b=$(basename "$f"); b=${b%.xz}; b=${b%.zst}; b=${b%.gz}
  case "$f" in
    *.xz) xz -dc "$f" > "$W/lib/modules/$b" ;; *.zst) zstd -qdc "$f" > "$W/lib/modules/$b" ;;
    *) cp "$f" "$W/lib/modules/$b" ;;
  esac
  echo "$b" >> "$W/modules.list"
done
(cd "$W" && find . | cpio -o -H newc --quiet | gzip -1 > "$TB/initrd.cpio.gz")
rm -rf "$W"
truncate -s 128M "$TB/data.img"
mkdir -p "$TB/www"; [ -s "$TB/www/blob16" ] || head -c 16M /dev/urandom > "$TB/www/blob16"
echo "prepared: $TB (kernel $KV)"
