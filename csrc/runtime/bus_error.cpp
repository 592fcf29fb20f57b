// megatron.dynapipe._bus_error: names the file behind a bus error before the rank dies.
//
// A rank reads its data (`.bin` files) and some checkpoints through memory maps. When such a
// file shrinks under the job (truncated or rewritten while training), touching a page past its
// new end raises SIGBUS, and the rank dies without saying which file. Python cannot handle a
// synchronous fault (its handlers run later, between bytecodes, and the access would fault
// again), so this handler is native: it looks the faulting address up in /proc/self/maps with
// async-signal-safe calls only (open, read, write, _exit), prints one line naming the file and
// the byte, and ends the process with exit status 1. A bus error outside any mapped file goes
// to the handler that was installed before, by returning: the access faults again.
#include <fcntl.h>
#include <pybind11/pybind11.h>
#include <signal.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace {

constexpr size_t kPrefixBytes = 512;
constexpr size_t kLineBytes = 8192;

char g_prefix[kPrefixBytes];  // "<program>: error: rank <r>: ", set once by install()
struct sigaction g_previous;

void put(const char* text, size_t size) {
  while (size > 0) {
    const ssize_t written = write(STDERR_FILENO, text, size);
    if (written <= 0) return;
    text += written;
    size -= static_cast<size_t>(written);
  }
}

void put(const char* text) { put(text, strlen(text)); }

void put_decimal(uint64_t value) {
  char digits[24];
  size_t n = 0;
  do {
    digits[sizeof digits - 1 - n++] = static_cast<char>('0' + value % 10);
    value /= 10;
  } while (value > 0);
  put(digits + sizeof digits - n, n);
}

// Parses hex digits at `*at` into `*value`; false when there are none.
bool parse_hex(const char** at, const char* end, uint64_t* value) {
  const char* p = *at;
  uint64_t v = 0;
  for (; p < end; ++p) {
    const char c = *p;
    int digit;
    if (c >= '0' && c <= '9') {
      digit = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      digit = c - 'a' + 10;
    } else {
      break;
    }
    v = (v << 4) | static_cast<uint64_t>(digit);
  }
  if (p == *at) return false;
  *at = p;
  *value = v;
  return true;
}

const char* skip_field(const char* p, const char* end) {
  while (p < end && *p != ' ') ++p;
  while (p < end && *p == ' ') ++p;
  return p;
}

// One /proc/self/maps line: "start-end perms offset dev inode   path". Reports and ends the
// process when `address` falls in a mapping of a file.
void report_if_mapped(const char* line, const char* end, uint64_t address) {
  const char* p = line;
  uint64_t start, stop, offset;
  if (!parse_hex(&p, end, &start) || p >= end || *p++ != '-') return;
  if (!parse_hex(&p, end, &stop) || address < start || address >= stop) return;
  p = skip_field(skip_field(p, end), end);  // the range's rest, then perms
  if (!parse_hex(&p, end, &offset)) return;
  p = skip_field(skip_field(skip_field(p, end), end), end);  // offset's rest, dev, inode
  if (p >= end || *p != '/') return;                         // anonymous, [heap], [stack]
  put(g_prefix);
  put(p, static_cast<size_t>(end - p));
  put(" changed while the job read it: bus error at byte ");
  put_decimal(offset + (address - start));
  put(" of its memory map, past the file's end now (truncated or rewritten while training?); "
      "restore it and resume from the last checkpoint\n");
  _exit(1);
}

void on_bus_error(int, siginfo_t* info, void*) {
  if (info->si_code <= 0) {  // sent by a process (kill, tgkill), not a fault: no address
    sigaction(SIGBUS, &g_previous, nullptr);
    raise(SIGBUS);
    return;
  }
  const uint64_t address = reinterpret_cast<uintptr_t>(info->si_addr);
  const int maps = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
  if (maps >= 0) {
    static char buffer[kLineBytes];
    size_t held = 0;
    for (;;) {
      const ssize_t got = read(maps, buffer + held, sizeof buffer - held);
      if (got <= 0) break;
      held += static_cast<size_t>(got);
      char* line = buffer;
      char* newline;
      while ((newline = static_cast<char*>(memchr(line, '\n', held - (line - buffer))))) {
        report_if_mapped(line, newline, address);
        line = newline + 1;
      }
      held -= static_cast<size_t>(line - buffer);
      memmove(buffer, line, held);
      if (held == sizeof buffer) held = 0;  // a line longer than the buffer: skip it
    }
    close(maps);
  }
  sigaction(SIGBUS, &g_previous,
            nullptr);  // not a mapped file: the fault repeats, handled as before
}

void install(const std::string& prefix) {
  const size_t size = prefix.size() < kPrefixBytes - 1 ? prefix.size() : kPrefixBytes - 1;
  memcpy(g_prefix, prefix.data(), size);
  g_prefix[size] = '\0';
  struct sigaction action, current;
  memset(&action, 0, sizeof action);
  action.sa_sigaction = on_bus_error;
  action.sa_flags = SA_SIGINFO;
  sigemptyset(&action.sa_mask);
  // A forked child (a data-loader worker) inherits this handler, but a library may have
  // replaced it since: install again, remembering whichever handler is not this one.
  if (sigaction(SIGBUS, &action, &current) != 0)
    throw std::runtime_error("sigaction(SIGBUS) failed");
  if (!((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_bus_error))
    g_previous = current;
}

}  // namespace

PYBIND11_MODULE(_bus_error, m) {
  m.doc() = "Names the memory-mapped file behind a bus error (SIGBUS) in one line, then exits 1.";
  m.def("install", &install, pybind11::arg("prefix"),
        "Handle SIGBUS in this process; `prefix` starts the line (program, rank). Call again to\n"
        "change the prefix or to take SIGBUS back from a handler installed since.");
}
