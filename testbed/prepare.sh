#!/bin/bash
# prepare.sh DIR -- the testbed's host side, once: Debian packages (qemu-system-x86, busybox-static, cpio, kmod,
# xz-utils, zstd), Debian 12's kernel and bookworm-backports' (downloaded and unpacked, never installed), and an
# initramfs per kernel of busybox, the virtio modules, the guest init and iommulab's capture script. Needs root.
set -euo pipefail
HERE=$(dirname "$(readlink -f "$0")")
TB=$(readlink -f "${1:?usage: prepare.sh DIR}")
mkdir -p "$TB" && cd "$TB"
export DEBIAN_FRONTEND=noninteractive
command -v qemu-system-x86_64 >/dev/null && command -v busybox >/dev/null || {
  apt-get update -qq
  apt-get install -y -q --no-install-recommends qemu-system-x86 busybox-static cpio kmod xz-utils zstd >/dev/null
}
# The kernels are downloaded once; the initramfs is rebuilt every time (a few seconds), so a changed guest init
# or capture script is what boots.
if [ -z "$(ls kroot/boot/vmlinuz-* 2>/dev/null)" ] || [ -z "$(ls kroot612/boot/vmlinuz-* 2>/dev/null)" ]; then
# Kernels: Debian 12's (6.1) and bookworm-backports' (6.12, which has CONFIG_VIRTIO_IOMMU=m), downloaded and
# unpacked, never installed. Backports is read through a private apt state under $TB/apt, so the system's apt
# configuration is left alone.
K=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-6/{print $2}' | head -1)
[ -n "$K" ] || { apt-get update -qq; K=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-6/{print $2}' | head -1); }
mkdir -p apt/lists/partial apt/cache/archives/partial
MIRROR=$({ cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null || true; } \
  | grep -E '^(URIs:|deb )' | grep -oE 'https?://[^ ]+/debian' | head -1 || true)
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] ${MIRROR:-http://deb.debian.org/debian} bookworm-backports main" > apt/bpo.list
BPO=(-o Dir::Etc::SourceList="$TB/apt/bpo.list" -o Dir::Etc::SourceParts=/nonexistent
     -o Dir::State::Lists="$TB/apt/lists" -o Dir::Cache="$TB/apt/cache")
apt-get "${BPO[@]}" update -qq
K612=$(apt-cache "${BPO[@]}" depends linux-image-amd64 | awk '/Depends: linux-image-6/{print $2}' | head -1)
rm -rf kroot kroot612 linux-image-*.deb
apt-get download "$K" >/dev/null
dpkg -x linux-image-*.deb kroot
rm -f linux-image-*.deb
apt-get "${BPO[@]}" download "$K612" >/dev/null
dpkg -x linux-image-*.deb kroot612
rm -f linux-image-*.deb
fi
K=$(ls kroot/lib/modules | head -1) K612=$(ls kroot612/lib/modules | head -1)

# initramfs ROOT OUT: busybox, the guest init, iommulab's capture script and the modules, virtio_iommu first so
# endpoints get their DMA domain before their drivers probe.
initramfs() {
  local KV W
  KV=$(ls "$1/lib/modules" | head -1)
  depmod -b "$1" "$KV"
  W=$(mktemp -d)
  mkdir -p "$W"/{bin,dev,proc,sys,tmp,lib/modules}
  cp /bin/busybox "$W/bin/busybox"
  cp "$HERE/guest-init.sh" "$W/init"; chmod +x "$W/init"
  python3 -c "import importlib.resources as r; print(r.files('iommulab').joinpath('capture.sh').read_text(), end='')" \
    > "$W/capture.sh" 2>/dev/null || cp "$HERE/../python/iommulab/capture.sh" "$W/capture.sh"
  : > "$W/modules.list"
  for m in virtio_iommu virtio_pci virtio_net virtio_blk; do
    modprobe -d "$1" -S "$KV" --show-depends "$m" 2>/dev/null | awk '$1=="insmod"{print $2}' || true
  done | awk '!seen[$0]++' | while read -r f; do
    b=$(basename "$f"); b=${b%.xz}; b=${b%.zst}; b=${b%.gz}
    case "$f" in
      *.xz) xz -dc "$f" > "$W/lib/modules/$b" ;; *.zst) zstd -qdc "$f" > "$W/lib/modules/$b" ;;
      *) cp "$f" "$W/lib/modules/$b" ;;
    esac
    echo "$b" >> "$W/modules.list"
  done
  (cd "$W" && find . | cpio -o -H newc --quiet | gzip -1 > "$2")
  rm -rf "$W"
}
initramfs "$TB/kroot" "$TB/initrd.cpio.gz"
initramfs "$TB/kroot612" "$TB/initrd612.cpio.gz"
truncate -s 128M "$TB/data.img"
mkdir -p "$TB/www"; [ -s "$TB/www/blob16" ] || head -c 16M /dev/urandom > "$TB/www/blob16"
echo "prepared: $TB (kernels $K, $K612)"
