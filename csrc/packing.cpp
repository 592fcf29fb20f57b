// Longest-processing-time-first packing over a range of micro-batch counts: Hydraulis (seed
// hydraulis.txt) §6.1, Eq. 1 and Appendix C. Mirrors dynapipe_planner/strategy/packing.py's
// `pack_lpt` + `pack_pipeline` loop step for step (same order, same tie-breaking, same float
// sums), so both pick the same packing.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <numeric>
#include <queue>
#include <utility>
#include <vector>

#include "core.h"

namespace py = pybind11;

namespace {

using Doubles = py::array_t<double, py::array::c_style | py::array::forcecast>;
using Ints = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using Slot = std::pair<double, int64_t>;  // (load, micro-batch), smallest first

// LPT into `count` micro-batches of at most `max_len` tokens: each sequence, longest time
// first, goes to the least loaded micro-batch with room. Returns each sequence's micro-batch,
// or an empty vector when a sequence finds no room.
std::vector<int64_t> pack_count(const std::vector<int64_t>& order, const double* times,
                                const int64_t* lengths, int64_t max_len, int64_t count) {
  std::vector<int64_t> bin(order.size(), -1), tokens(count, 0);
  std::priority_queue<Slot, std::vector<Slot>, std::greater<Slot>> heap;
  for (int64_t j = 0; j < count; ++j) heap.emplace(0.0, j);
  std::vector<Slot> waiting;
  for (const int64_t i : order) {
    waiting.clear();
    while (!heap.empty() && tokens[heap.top().second] + lengths[i] > max_len) {
      waiting.push_back(heap.top());
      heap.pop();
    }
    if (heap.empty()) return {};
    const Slot slot = heap.top();
    heap.pop();
    bin[i] = slot.second;
    tokens[slot.second] += lengths[i];
    heap.emplace(slot.first + times[i], slot.second);
    for (const Slot& item : waiting) heap.push(item);
  }
  return bin;
}

// Best Eq. 1 packing over counts low..high: (micro-batch of each sequence numbered over the
// non-empty micro-batches in order, objective); an all -1 assignment when no count fits.
std::pair<Ints, double> pack_lpt_best(const Doubles& times_in, const Ints& lengths_in,
                                      int64_t max_len, int64_t low, int64_t high, int64_t pp) {
  const int64_t n = times_in.shape(0);
  const double* times = times_in.data();
  const int64_t* lengths = lengths_in.data();
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [times](int64_t a, int64_t b) { return times[a] > times[b]; });
  std::vector<int64_t> best_bin(n, -1);
  double best = 0.0;
  bool found = false;
  for (int64_t count = low; count <= high; ++count) {
    std::vector<int64_t> bin = pack_count(order, times, lengths, max_len, count);
    if (bin.empty() && n > 0) continue;
    // Sum each micro-batch in ascending sequence order, as the Python reference does.
    std::vector<double> load(count, 0.0);
    std::vector<int64_t> members(count, 0), renumber(count, -1);
    for (int64_t i = 0; i < n; ++i) {
      load[bin[i]] += times[i];
      ++members[bin[i]];
    }
    int64_t used = 0;
    double slowest = 0.0;
    for (int64_t j = 0; j < count; ++j) {
      if (members[j] == 0) continue;
      renumber[j] = used++;
      if (load[j] > slowest) slowest = load[j];
    }
    const double objective = slowest * static_cast<double>(pp - 1 + used);
    if (!found || objective < best) {
      found = true;
      best = objective;
      for (int64_t i = 0; i < n; ++i) best_bin[i] = renumber[bin[i]];
    }
  }
  Ints out(n);
  std::copy(best_bin.begin(), best_bin.end(), out.mutable_data());
  return {out, best};
}

}  // namespace

void register_packing(py::module_& m) {
  m.def("pack_lpt_best", &pack_lpt_best, py::arg("times"), py::arg("lengths"), py::arg("max_len"),
        py::arg("low"), py::arg("high"), py::arg("pp"),
        "Eq. 1 packing by LPT over micro-batch counts low..high (Hydraulis §6.1).");
}
