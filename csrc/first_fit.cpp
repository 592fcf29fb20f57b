// First-fit-decreasing bin packing of sample lengths into rows (the packing baseline of
// DynaPipe, seed dynapipe.txt §2.2 and §8.4, and the packed rows of DynaPipe's own plans).
// Mirrors dynapipe_planner/microbatch/baselines.py's `first_fit_decreasing_reference` (same
// stable order, same bins); a max tree over the bins' free room finds the first bin with room
// in O(log bins) instead of a scan per sample.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <vector>

#include "core.h"

namespace py = pybind11;

namespace {

using Ints = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

std::vector<std::vector<int64_t>> first_fit_decreasing(const int64_t* lengths, int64_t n,
                                                       int64_t capacity) {
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [lengths](int64_t a, int64_t b) { return lengths[a] > lengths[b]; });
  int64_t leaves = 1;
  while (leaves < std::max<int64_t>(n, 1)) leaves *= 2;
  // room[leaves + k] is bin k's free room, -1 while it is not open; inner nodes hold maxima.
  std::vector<int64_t> room(2 * leaves, -1);
  auto set_room = [&](int64_t k, int64_t value) {
    int64_t node = leaves + k;
    room[node] = value;
    for (node /= 2; node >= 1; node /= 2) room[node] = std::max(room[2 * node], room[2 * node + 1]);
  };
  std::vector<std::vector<int64_t>> bins;
  for (const int64_t i : order) {
    const int64_t size = lengths[i];
    if (room[1] >= size) {
      int64_t node = 1;
      while (node < leaves) node = room[2 * node] >= size ? 2 * node : 2 * node + 1;
      const int64_t k = node - leaves;
      bins[k].push_back(i);
      set_room(k, room[node] - size);
    } else {
      bins.push_back({i});
      set_room(static_cast<int64_t>(bins.size()) - 1, capacity - size);
    }
  }
  return bins;
}

}  // namespace

void register_first_fit(py::module_& m) {
  m.def(
      "first_fit_decreasing",
      [](const Ints& lengths, int64_t capacity) {
        if (lengths.ndim() != 1) throw std::invalid_argument("lengths must be 1-D");
        const int64_t* data = lengths.data();
        const int64_t n = lengths.shape(0);
        std::vector<std::vector<int64_t>> bins;
        {
          py::gil_scoped_release release;
          bins = first_fit_decreasing(data, n, capacity);
        }
        return bins;
      },
      py::arg("lengths"), py::arg("capacity"),
      "First-fit-decreasing bins of sample indices (each bin's lengths sum to <= capacity).");
}
