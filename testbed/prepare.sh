#!/bin/bash
# prepare.sh DIR [x86|arm64] [7.3] -- the testbed's host side, once: Debian packages, two Debian kernels of the
# architecture (Debian 12's 6.1 and bookworm-backports' 6.12, downloaded and unpacked, never installed), and an
# initramfs per kernel of busybox, the modules, the guest init and iommulab's capture script. Needs root.
#   x86 (default): qemu-system-x86 (VT-d, virtio-iommu), the host's busybox-static; files in DIR.
#   arm64: qemu-system-arm (-machine virt,iommu=smmuv3), busybox-static:arm64; files in DIR/arm64.
#   7.3: also Debian 13 trixie-backports' Linux 7.3, a kernel after the newest the model knows
#   (`boot.py --kernel 7.3`).
set -euo pipefail
HERE=$(dirname "$(readlink -f "$0")")
TB=$(readlink -f "${1:?usage: prepare.sh DIR [x86|arm64]}")
ARCH=${2:-x86}
NEWER=${3:-}
case $NEWER in ''|7.3) ;; *) echo "prepare.sh: kernel '$NEWER': expected 7.3 (or nothing)" >&2; exit 2 ;; esac
case $ARCH in
  x86) QEMU=qemu-system-x86_64 QPKG=qemu-system-x86 DEB=amd64 K=$TB ;;
  arm64) QEMU=qemu-system-aarch64 QPKG=qemu-system-arm DEB=arm64 K=$TB/arm64 ;;
  *) echo "prepare.sh: architecture '$ARCH': expected x86 or arm64" >&2; exit 2 ;;
esac
mkdir -p "$K" && cd "$K"
export DEBIAN_FRONTEND=noninteractive
command -v $QEMU >/dev/null && command -v busybox >/dev/null && command -v cpio >/dev/null || {
  apt-get update -qq
  apt-get install -y -q --no-install-recommends $QPKG busybox-static cpio kmod xz-utils zstd >/dev/null
}
# The system's Debian mirrors, if it names any.
SRC=$({ cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null || true; } \
  | grep -E '^(URIs:|deb )' || true)
MIRROR=$(echo "$SRC" | grep -oE 'https?://[^ ]+/debian' | head -1 || true)
SECMIRROR=$(echo "$SRC" | grep -oE 'https?://[^ ]+/debian-security' | head -1 || true)
# The kernels are downloaded once; the initramfs is rebuilt every time (a few seconds), so a changed guest init
# or capture script is what boots.
if [ -z "$(ls kroot/boot/vmlinuz-* 2>/dev/null)" ] || [ -z "$(ls kroot612/boot/vmlinuz-* 2>/dev/null)" ] \
   || { [ $ARCH = arm64 ] && [ ! -x bbroot/bin/busybox ]; }; then
# Kernels (and for arm64 its busybox): Debian 12's linux-image (6.1) and bookworm-backports' (6.12, which has
# CONFIG_VIRTIO_IOMMU=m), read through a private apt state under apt/ for the architecture, so the system's apt
# and dpkg configuration is left alone (no foreign architecture is added).
mkdir -p apt/lists/partial apt/cache/archives/partial
KR="[arch=$DEB signed-by=/usr/share/keyrings/debian-archive-keyring.gpg]"
cat > apt/sources.list <<EOL
deb $KR ${MIRROR:-http://deb.debian.org/debian} bookworm main
deb $KR ${MIRROR:-http://deb.debian.org/debian} bookworm-updates main
deb $KR ${SECMIRROR:-http://deb.debian.org/debian-security} bookworm-security main
deb $KR ${MIRROR:-http://deb.debian.org/debian} bookworm-backports main
EOL
A=(-o Dir::Etc::SourceList="$K/apt/sources.list" -o Dir::Etc::SourceParts=/nonexistent
   -o Dir::State::Lists="$K/apt/lists" -o Dir::Cache="$K/apt/cache" -o Dir::State::status=/dev/null
   -o APT::Architecture=$DEB -o APT::Architectures::=$DEB -o APT::Sandbox::User=root)
apt-get "${A[@]}" update -qq
# 6.1: the candidate of linux-image-<arch> (backports is pinned low, so bookworm/-security wins); 6.12: backports'.
K61=$(apt-cache "${A[@]}" depends linux-image-$DEB | awk '/Depends: linux-image-6/{print $2}' | head -1)
V612=$(apt-cache "${A[@]}" madison linux-image-$DEB | awk -F'|' '/bookworm-backports/{gsub(/ /,"",$2); print $2}' | head -1)
K612=$(apt-cache "${A[@]}" depends "linux-image-$DEB=$V612" | awk '/Depends: linux-image-6/{print $2}' | head -1)
[ -n "$K61" ] && [ -n "$K612" ] || { echo "prepare.sh: no $DEB kernel packages found in $K/apt/sources.list" >&2; exit 1; }
rm -rf kroot kroot612 bbroot debs && mkdir debs
(cd debs && apt-get "${A[@]}" download "$K61" "$K612" $([ $ARCH = arm64 ] && echo busybox-static) >/dev/null)
dpkg -x debs/"$K61"_*.deb kroot
dpkg -x debs/"$K612"_*.deb kroot612
[ $ARCH = x86 ] || dpkg -x debs/busybox-static_*.deb bbroot
ls debs > packages.txt
rm -rf debs
fi
BB=/bin/busybox; [ $ARCH = arm64 ] && BB=$K/bbroot/bin/busybox
# Linux 7.3 from trixie-backports, through a private apt state of its own (the 6.1 and 6.12 choices above read
# bookworm's): linux-binary- holds vmlinuz in /usr/lib/modules/VERSION, linux-modules- the modules, linux-base- the
# rest of that directory.
if [ -n "$NEWER" ] && [ -z "$(ls kroot73/boot/vmlinuz-* 2>/dev/null)" ]; then
  mkdir -p apt73/lists/partial apt73/cache/archives/partial
  echo "deb [arch=$DEB signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] ${MIRROR:-http://deb.debian.org/debian} trixie-backports main" \
    > apt73/sources.list
  A73=(-o Dir::Etc::SourceList="$K/apt73/sources.list" -o Dir::Etc::SourceParts=/nonexistent
       -o Dir::State::Lists="$K/apt73/lists" -o Dir::Cache="$K/apt73/cache" -o Dir::State::status=/dev/null
       -o APT::Architecture=$DEB -o APT::Architectures::=$DEB -o APT::Sandbox::User=root)
  apt-get "${A73[@]}" update -qq
  V73=$(apt-cache "${A73[@]}" madison linux-image-$DEB | awk -F'|' '{gsub(/ /,"",$2); print $2}' | grep '^7\.3\.' | head -1)
  R73=$(apt-cache "${A73[@]}" depends "linux-image-$DEB=$V73" 2>/dev/null | awk '/Depends: linux-image-7/{print $2}' | head -1)
  R73=${R73#linux-image-}
  [ -n "$R73" ] || { echo "prepare.sh: no Linux 7.3 in trixie-backports ($K/apt73/sources.list)" >&2; exit 1; }
  rm -rf kroot73 debs73 && mkdir debs73
  (cd debs73 && apt-get "${A73[@]}" download "linux-base-$R73" "linux-binary-$R73" "linux-modules-$R73" >/dev/null)
  for d in debs73/*.deb; do dpkg -x "$d" kroot73; done
  mkdir -p kroot73/boot && ln -sfn usr/lib kroot73/lib  # merged /usr: the modules are in usr/lib/modules
  ln -sf "../usr/lib/modules/$R73/vmlinuz" "kroot73/boot/vmlinuz-$R73"
  ls debs73 >> packages.txt
  rm -rf debs73
fi

# initramfs ROOT OUT: busybox, the guest init, iommulab's capture script and the modules, virtio_iommu first so
# endpoints get their DMA domain before their drivers probe. (arm64: arm-smmu-v3, pci-host-generic and the PL011
# console are built in; virtio_pci is a module in 6.1 and built in in 6.12, where modprobe prints no insmod.)
initramfs() {
  local KV W
  KV=$(ls "$1/lib/modules" | head -1)
  depmod -b "$1" "$KV"
  W=$(mktemp -d)
  mkdir -p "$W"/{bin,dev,proc,sys,tmp,lib/modules}
  cp "$BB" "$W/bin/busybox"
  cp "$HERE/guest-init.sh" "$W/init"; chmod +x "$W/init"
  python3 -c "import importlib.resources as r; print(r.files('iommulab').joinpath('capture.sh').read_text(), end='')" \
    > "$W/capture.sh" 2>/dev/null || cp "$HERE/../python/iommulab/capture.sh" "$W/capture.sh"
  : > "$W/modules.list"
  for m in virtio_iommu virtio_pci virtio_net virtio_blk nvme; do
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
initramfs "$K/kroot" "$K/initrd.cpio.gz"
initramfs "$K/kroot612" "$K/initrd612.cpio.gz"
[ -z "$NEWER" ] || initramfs "$K/kroot73" "$K/initrd73.cpio.gz"
[ -s "$TB/data.img" ] || truncate -s 128M "$TB/data.img"
mkdir -p "$TB/www"; [ -s "$TB/www/blob16" ] || head -c 16M /dev/urandom > "$TB/www/blob16"
echo "prepared: $K (kernels $(ls kroot/lib/modules | head -1), $(ls kroot612/lib/modules | head -1)$([ -z "$NEWER" ] || echo ", $(ls kroot73/lib/modules | head -1)"))"
