"""Fake GPU drivers for the gpu_preflight tests (stdlib only, Python 3.6+).

build_fake_nvml() compiles tests/fake_nvml.c into a libnvidia-ml.so.1 whose
scenario is chosen per call with FAKE_NVML_* variables (see the comment at the
top of fake_nvml.c). write_fake_smi() writes a POSIX sh nvidia-smi that
answers the CSV queries the script makes, chosen with FAKE_SMI_* variables.
make_amd_sysfs() lays out a /sys/class/drm tree with amdgpu's files. Both
NVIDIA fakes describe the same GPUs: "NVIDIA H200", 143771 MiB, 542 MiB
reserved, UUID GPU-<8 x hex digit 10+i>-5e1f-4c2d-9a7b-0123456789ab.
"""

import os
import re
import shutil
import stat
import subprocess

TESTS = os.path.dirname(os.path.abspath(__file__))
FAKE_NVML_C = os.path.join(TESTS, "fake_nvml.c")

MIB = 1048576
TOTAL_MIB = 143771
RESERVED_MIB = 542
BUSY_MIB = 102400
MIG_USED_MIB = 20480
FREE_MIB = TOTAL_MIB - RESERVED_MIB          # v2 free of an idle GPU
BUSY_PID = 4242
MIG_PID = 4343
DRIVER_VERSION = "550.127.05"
GPU_NAME = "NVIDIA H200"
MAX_GPUS = 8


def gpu_uuid(index):
    """The UUID both NVIDIA fakes give GPU `index` (0..5)."""
    return "GPU-%s-5e1f-4c2d-9a7b-0123456789ab" % ("%x" % (10 + index) * 8)


def mig_uuid(index, slot):
    """The UUID of MIG slot `slot` (0 or 1) of GPU `index` in mode mig."""
    return "MIG-%s-0000-4000-8000-00000000000%d" % ("%x" % (10 + index) * 8, slot)


def pci_bus_id(index):
    """The fake nvidia-smi's pci.bus_id of GPU `index`."""
    return "00000000:6%d:00.0" % (index + 1)


def find_compiler():
    """The C compiler: cc, else gcc; RuntimeError when there is neither."""
    found = shutil.which("cc") or shutil.which("gcc")
    if not found:
        raise RuntimeError("no C compiler: neither 'cc' nor 'gcc' is on PATH "
                           "(needed to build the fake libnvidia-ml.so.1)")
    return found


def build_fake_nvml(dest_dir, variant="full", default_mode=None, default_runners=None):
    """Compile the fake NVML into dest_dir/libnvidia-ml.so.1; return its path.

    variant "full" exports every symbol; "old" is a pre-R510 driver without
    nvmlDeviceGetMemoryInfo_v2 and nvmlDeviceGetComputeRunningProcesses_v3/_v2.
    default_mode: the FAKE_NVML_MODE the library acts in when that variable
    is unset (for callers that clear the environment, like slurmd), else free.
    default_runners: likewise the FAKE_NVML_RUNNERS file (an emulator's
    gpu_file: the model runners it has on GPU 0).
    """
    if variant not in ("full", "old"):
        raise ValueError("variant must be 'full' or 'old', not %r" % (variant,))
    if default_mode is not None and not re.match(r"^[a-z_]+$", default_mode):
        raise ValueError("default_mode must be a mode name, not %r" % (default_mode,))
    compiler = find_compiler()
    os.makedirs(dest_dir, exist_ok=True)
    path = os.path.join(dest_dir, "libnvidia-ml.so.1")
    cmd = [compiler, "-shared", "-fPIC", "-O1", "-Wall", "-Werror"]
    if variant == "old":
        cmd.append("-DFAKE_OLD_DRIVER")
    if default_mode is not None:
        cmd.append('-DFAKE_NVML_DEFAULT_MODE="%s"' % default_mode)
    if default_runners is not None:
        if not re.match(r"^/[A-Za-z0-9._/-]+$", default_runners):
            raise ValueError("default_runners must be an absolute path, not %r"
                             % (default_runners,))
        cmd.append('-DFAKE_NVML_DEFAULT_RUNNERS="%s"' % default_runners)
    return compile_fake(cmd + ["-o", path, FAKE_NVML_C], "NVML", path)


def compile_fake(cmd, what, path):
    """Run the compiler command cmd that builds the fake library what at path;
    path, or RuntimeError with the compiler's output."""
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = proc.communicate()[0].decode("utf-8", "replace")
    if proc.returncode != 0:
        raise RuntimeError("building the fake %s failed (%s, exit %d):\n%s"
                           % (what, " ".join(cmd), proc.returncode, output))
    return path


def build_fake_cuda(dest_dir, include_dir=None):
    """Compile tests/fake_cuda.c into dest_dir/libcuda.so.1 (against cuda.h
    in include_dir when given); return its path."""
    path = os.path.join(dest_dir, "libcuda.so.1")
    cmd = [find_compiler(), "-shared", "-fPIC", "-O1", "-Wall", "-Werror"]
    if include_dir:
        cmd += ["-DFAKE_CUDA_WITH_HEADER", "-I", include_dir]
    return compile_fake(cmd + ["-o", path, os.path.join(TESTS, "fake_cuda.c")], "CUDA", path)


FAKE_SMI = r"""#!/bin/sh
# Fake nvidia-smi written by tests/fakes.py (write_fake_smi). It emulates
#   nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits
#   nvidia-smi --query-compute-apps=FIELDS --format=csv,noheader,nounits
#   nvidia-smi --version
# for the same GPUs as tests/fake_nvml.c. Scenario from the environment:
#   FAKE_SMI_MODE  free (default) | busy | na | notsupported | lost |
#                  nodriver | mismatch | mig | hang
#   FAKE_SMI_COUNT number of GPUs, 0..8 (default 1)
#   FAKE_SMI_BUSY  comma list of busy indexes (modes free, na, notsupported,
#                  lost)
#   FAKE_SMI_LOST_INDEX  the lost GPU in mode lost (default: the last)
#   FAKE_SMI_LOST_FORMAT index (default: "...for GPU1: 0000:62:00.0: GPU is
#                  lost...", current drivers) or bus ("...for GPU
#                  00000000:62:00.0: ...", older ones)
#   FAKE_SMI_LOG   append "argv: ARGS" and "LC_ALL=VALUE" per call

if [ -n "${FAKE_SMI_LOG:-}" ]; then
    printf 'argv: %s\nLC_ALL=%s\n' "$*" "${LC_ALL:-}" >>"$FAKE_SMI_LOG"
fi

mode=${FAKE_SMI_MODE:-free}
count=${FAKE_SMI_COUNT:-1}
case $count in
    '' | *[!0-9]*) count=1 ;;
esac
[ "$count" -gt 6 ] && count=6
lost=${FAKE_SMI_LOST_INDEX:-$((count - 1))}
busy_list=${FAKE_SMI_BUSY:-}

case $mode in
    free | busy | na | notsupported | lost | nodriver | mismatch | mig | hang) ;;
    *)
        echo "fake nvidia-smi: unknown FAKE_SMI_MODE '$mode'" >&2
        exit 255
        ;;
esac

kind=
fields=
format=
for arg in "$@"; do
    case $arg in
        --query-gpu=*)
            kind=gpu
            fields=${arg#--query-gpu=}
            ;;
        --query-compute-apps=*)
            kind=apps
            fields=${arg#--query-compute-apps=}
            ;;
        --format=*) format=${arg#--format=} ;;
        --version) kind=version ;;
        *)
            echo "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help."
            exit 2
            ;;
    esac
done

if [ -z "$kind" ]; then
    echo "fake nvidia-smi: only --query-gpu, --query-compute-apps and --version are emulated"
    exit 2
fi

set -f
if [ "$kind" != version ]; then
    if [ -z "$fields" ]; then
        echo "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help."
        exit 2
    fi
    IFS=,
    for field in $fields; do
        case $kind:$field in
            gpu:index | gpu:uuid | gpu:name | gpu:pci.bus_id | gpu:memory.total | \
                gpu:memory.used | gpu:memory.free | gpu:utilization.gpu | \
                gpu:temperature.gpu) ;;
            apps:gpu_uuid | apps:pid | apps:used_gpu_memory) ;;
            *)
                echo "Field \"$field\" is not a valid field to query."
                exit 2
                ;;
        esac
    done
    unset IFS
    if [ -z "$format" ]; then
        echo "The --format option is required with --query-$kind; use --format=csv,noheader,nounits."
        exit 2
    fi
    if [ "$format" != csv,noheader,nounits ]; then
        echo "fake nvidia-smi: only --format=csv,noheader,nounits is emulated, not '$format'"
        exit 2
    fi
fi

case $mode in
    hang)
        sleep 3600
        exit 1
        ;;
    nodriver)
        echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest NVIDIA driver is installed and running."
        exit 9
        ;;
    mismatch)
        echo "Failed to initialize NVML: Driver/library version mismatch"
        exit 18
        ;;
esac

if [ "$kind" = version ]; then
    echo "NVIDIA-SMI version  : 550.127.05"
    echo "NVML version        : 550.127"
    echo "DRIVER version      : 550.127.05"
    echo "CUDA Version        : 12.4"
    exit 0
fi

# State of GPU $1: free, busy or mig.
state() {
    case $mode in
        busy) echo busy ;;
        mig) echo mig ;;
        *)
            case ",$busy_list," in
                *,"$1",*) echo busy ;;
                *) echo free ;;
            esac
            ;;
    esac
}

# Print the asked fields of GPU $1 (query-gpu) or of its process
# (query-compute-apps), joined by ", ".
row() {
    i=$1
    s=$(state "$i")
    digit=$(printf '%x' $((10 + i)))
    uuid="GPU-$digit$digit$digit$digit$digit$digit$digit$digit-5e1f-4c2d-9a7b-0123456789ab"
    case $s in
        busy) used=102400 util=97 temp=83 pid=4242 ;;
        mig) used=20480 util='[N/A]' temp=40 pid=4343 ;;
        *) used=0 util=0 temp=29 pid= ;;
    esac
    case $mode in
        na) util='[N/A]' temp='[N/A]' ;;
        notsupported) util='[Not Supported]' temp='[Not Supported]' ;;
    esac
    if [ "$kind" = apps ] && [ -z "$pid" ]; then
        return 0
    fi
    line=
    sep=
    IFS=,
    for field in $fields; do
        case $field in
            index) value=$i ;;
            uuid | gpu_uuid) value=$uuid ;;
            name) value="NVIDIA H200" ;;
            pci.bus_id) value="00000000:6$((i + 1)):00.0" ;;
            memory.total) value=143771 ;;
            memory.used | used_gpu_memory) value=$used ;;
            memory.free) value=$((143771 - 542 - used)) ;;
            utilization.gpu) value=$util ;;
            temperature.gpu) value=$temp ;;
            pid) value=$pid ;;
        esac
        line="$line$sep$value"
        sep=", "
    done
    unset IFS
    printf '%s\n' "$line"
}

status=0
i=0
while [ "$i" -lt "$count" ]; do
    if [ "$mode" = lost ] && [ "$i" = "$lost" ]; then
        if [ "${FAKE_SMI_LOST_FORMAT:-index}" = bus ]; then     # older drivers
            echo "Unable to determine the device handle for GPU 00000000:6$((i + 1)):00.0: GPU is lost. Reboot the system to recover this GPU"
        else
            echo "Unable to determine the device handle for GPU$i: 0000:6$((i + 1)):00.0: GPU is lost.  Reboot the system to recover this GPU"
        fi
        status=15
    else
        row "$i"
    fi
    i=$((i + 1))
done
exit "$status"
"""


def write_fake_smi(dest_dir):
    """Write the fake nvidia-smi (POSIX sh) as dest_dir/nvidia-smi; its path."""
    os.makedirs(dest_dir, exist_ok=True)
    path = os.path.join(dest_dir, "nvidia-smi")
    with open(path, "w") as handle:
        handle.write(FAKE_SMI)
    os.chmod(path, stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP  # novermin
             | stat.S_IROTH | stat.S_IXOTH)
    return path


def _write(path, text):
    with open(path, "w") as handle:
        handle.write(text)


def add_pci_display(root, bdf, vendor, pci_class="0x030000"):
    """A PCI display controller under root's /sys/bus/pci/devices (a link into
    /sys/devices, as on a real host): vendor "0x10de" NVIDIA, "0x1002" AMD;
    pci_class another device's ("0x040300" a GPU's audio function)."""
    device = os.path.join(root, "sys", "devices", "pci0000:00", bdf)
    os.makedirs(device, exist_ok=True)
    _write(os.path.join(device, "vendor"), vendor + "\n")
    _write(os.path.join(device, "class"), pci_class + "\n")
    bus = os.path.join(root, "sys", "bus", "pci", "devices")
    os.makedirs(bus, exist_ok=True)
    os.symlink(os.path.join("..", "..", "..", "devices", "pci0000:00", bdf),
               os.path.join(bus, bdf))
    return root


def make_amd_sysfs(root, cards):
    """Build a fake /sys/class/drm under root (for GPU_PREFLIGHT_ROOT); root.

    cards: a list of dicts, one per cardN, keys (all optional):
      busy (0), used_mib (0), total_mib (65536), temp_c (None: no hwmon),
      unique_id (None: no file), name (None: no product_name),
      vendor ("0x1002"), busy_text (None; raw text of gpu_busy_percent,
      e.g. "" or "garbage"), hwmon ("hwmon0"; real numbering is global).
    As on a real host, /sys/class/drm/cardN is a symlink into
    /sys/devices/pci0000:00/0000:0X:00.0/drm/cardN, whose "device" is a
    symlink to the PCI device directory holding the amdgpu files. Clutter:
    connectors cardN-DP-1 (their "device" is the card node, so no amdgpu
    files under it), renderD(128+N), a "version" file.
    """
    sys_dir = os.path.join(root, "sys")
    drm = os.path.join(sys_dir, "class", "drm")
    os.makedirs(drm, exist_ok=True)
    _write(os.path.join(drm, "version"), "drm 1.1.0 20060810\n")
    for n, card in enumerate(cards):
        bdf = "0000:%02x:00.0" % (0x03 + n)
        pci_dir = os.path.join(sys_dir, "devices", "pci0000:00", bdf)
        drm_dir = os.path.join(pci_dir, "drm")
        card_name = "card%d" % n
        render_name = "renderD%d" % (128 + n)
        connector = "%s-DP-1" % card_name

        # the PCI device: amdgpu's files
        os.makedirs(pci_dir, exist_ok=True)
        _write(os.path.join(pci_dir, "vendor"),
               "%s\n" % card.get("vendor", "0x1002"))
        busy_text = card.get("busy_text")
        if busy_text is None:
            busy_text = "%d\n" % card.get("busy", 0)
        _write(os.path.join(pci_dir, "gpu_busy_percent"), busy_text)
        _write(os.path.join(pci_dir, "mem_info_vram_used"),
               "%d\n" % (card.get("used_mib", 0) * MIB))
        _write(os.path.join(pci_dir, "mem_info_vram_total"),
               "%d\n" % (card.get("total_mib", 65536) * MIB))
        if card.get("unique_id") is not None:
            _write(os.path.join(pci_dir, "unique_id"), "%s\n" % card["unique_id"])
        if card.get("name") is not None:
            _write(os.path.join(pci_dir, "product_name"), "%s\n" % card["name"])
        if card.get("temp_c") is not None:
            hwmon = os.path.join(pci_dir, "hwmon", card.get("hwmon", "hwmon0"))
            os.makedirs(hwmon, exist_ok=True)
            _write(os.path.join(hwmon, "temp1_input"),
                   "%d\n" % int(round(card["temp_c"] * 1000)))

        # the DRM nodes under the device, each with a "device" link back
        for node in (card_name, render_name, os.path.join(card_name, connector)):
            node_dir = os.path.join(drm_dir, node)
            os.makedirs(node_dir, exist_ok=True)
            _write(os.path.join(node_dir, "uevent"), "")
        for node in (card_name, render_name):
            link = os.path.join(drm_dir, node, "device")
            if not os.path.lexists(link):
                os.symlink(os.path.join("..", ".."), link)
        link = os.path.join(drm_dir, card_name, connector, "device")
        if not os.path.lexists(link):       # a connector's device is its card
            os.symlink("..", link)
        _write(os.path.join(drm_dir, card_name, connector, "status"),
               "disconnected\n")

        # /sys/class/drm entries are symlinks into /sys/devices
        targets = {
            card_name: os.path.join(drm_dir, card_name),
            render_name: os.path.join(drm_dir, render_name),
            connector: os.path.join(drm_dir, card_name, connector),
        }
        for name, target in sorted(targets.items()):
            link = os.path.join(drm, name)
            if not os.path.lexists(link):
                os.symlink(os.path.relpath(target, drm), link)
    return root
