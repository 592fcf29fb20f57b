// The strategy proposal DP of Hydraulis (seed hydraulis.txt §7, Eq. 4) on a grid of `step`
// GPUs and pipelines. Mirrors dynapipe_planner/strategy/proposal.py's `proposal_dp_reference`
// (same t[n][l], same choices, ties broken the same way). The reference finds, for every block
// (start, l] and scheme k, the pipeline count d where the leftover latency t[n - d N_k][start]
// (rising with d) reaches the block's own latency W / d (falling) by bisection; here the same
// crossing is kept per (l, start, k) from one n to the next and only moves up, because t never
// increases with n: O(K (N / step) L^2) work in all, the bisection's log factor gone.
// The DP runs column by column (every l for all n) rather than row by row, which gives the
// same values.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

#include "core.h"

namespace py = pybind11;

namespace {

using Matrix = py::array_t<double, py::array::c_style | py::array::forcecast>;
using Ints = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// t is (units + 1, L + 1) row-major; choice is (units + 1, L + 1, 3): scheme, pipelines in
// step units, block start (-1 where t[n][l] came from t[n - 1][l]). Column l of t needs only
// columns before it and its own earlier rows, so the DP runs column by column: the crossings
// kept for one l fit in cache, and `column` holds t by column, contiguous in n.
void proposal_dp(const double* work, const int64_t* gpus, int64_t num_intervals,
                 int64_t num_schemes, int64_t units, double step, double* t, int64_t* choice) {
  const int64_t width = num_intervals + 1, height = units + 1;
  // prefix[l * K + k]: scheme k's work over the first l intervals where it holds them.
  std::vector<double> prefix((num_intervals + 1) * num_schemes, 0.0);
  for (int64_t l = 1; l <= num_intervals; ++l) {
    for (int64_t k = 0; k < num_schemes; ++k) {
      const double w = work[(l - 1) * num_schemes + k];
      prefix[l * num_schemes + k] =
          prefix[(l - 1) * num_schemes + k] + (std::isfinite(w) ? w : 0.0);
    }
  }
  std::vector<double> column(width * height, kInf);  // column[l * height + n] = t[n][l]
  std::fill(column.begin(), column.begin() + height, 0.0);
  std::fill(choice, choice + height * width * 3, -1);
  // crossing[start * K + k]: for the current l, the first d index (d = index + 1 step units)
  // whose leftover latency reaches the block's, or `most` when none does yet.
  std::vector<int64_t> crossing(num_intervals * num_schemes);
  for (int64_t l = 1; l <= num_intervals; ++l) {
    std::fill(crossing.begin(), crossing.end(), 0);
    std::vector<int64_t> holders;  // the schemes that hold interval l
    for (int64_t k = 0; k < num_schemes; ++k) {
      if (std::isfinite(work[(l - 1) * num_schemes + k])) holders.push_back(k);
    }
    double* own_column = column.data() + l * height;
    for (int64_t n = 1; n <= units; ++n) {
      double best_value = kInf;
      int64_t best_start = 0, best_k = -1, best_d = 0;
      for (int64_t start = 0; start < l; ++start) {
        const double* before = column.data() + start * height;
        // Every candidate of this start is at least its least leftover latency, t[n - 1][start]
        // (t never increases with n); one that cannot go below the best so far, or below
        // t[n - 1][l], changes neither t nor the choice (ties keep the first), so it is skipped.
        // A skipped crossing is caught up later: it only moves up.
        const double bar = std::min(best_value, own_column[n - 1]);
        if (before[n - 1] >= bar) continue;
        double value = kInf;
        int64_t value_k = -1, value_d = 0;
        for (const int64_t k : holders) {
          const int64_t most = n / gpus[k];
          if (most == 0 || before[n - gpus[k]] >= std::min(bar, value)) continue;
          const double block = prefix[l * num_schemes + k] - prefix[start * num_schemes + k];
          auto rest = [&](int64_t i) { return before[n - gpus[k] * (i + 1)]; };
          auto own = [&](int64_t i) { return block / (static_cast<double>(i + 1) * step); };
          int64_t& lo = crossing[start * num_schemes + k];
          while (lo < most && !(rest(lo) >= own(lo))) ++lo;
          for (const int64_t i : {lo, lo - 1}) {
            if (i < 0 || i >= most) continue;
            const double candidate = std::max(rest(i), own(i));
            if (candidate < value) {
              value = candidate;
              value_k = k;
              value_d = i + 1;
            }
          }
        }
        if (value < best_value) {
          best_value = value;
          best_start = start;
          best_k = value_k;
          best_d = value_d;
        }
      }
      if (best_value < own_column[n - 1]) {
        own_column[n] = best_value;
        int64_t* chosen = choice + (n * width + l) * 3;
        chosen[0] = best_k;
        chosen[1] = best_d;
        chosen[2] = best_start;
      } else {
        own_column[n] = own_column[n - 1];
      }
    }
  }
  for (int64_t n = 0; n < height; ++n) {
    for (int64_t l = 0; l < width; ++l) t[n * width + l] = column[l * height + n];
  }
}

}  // namespace

void register_proposal_dp(py::module_& m) {
  m.def(
      "proposal_dp",
      [](const Matrix& work, const Ints& gpus, int64_t units, double step) {
        if (work.ndim() != 2) throw std::invalid_argument("work must be (intervals, schemes)");
        const int64_t num_intervals = work.shape(0), num_schemes = work.shape(1);
        if (gpus.ndim() != 1 || gpus.shape(0) != num_schemes) {
          throw std::invalid_argument("gpus: one GPU count per scheme expected");
        }
        for (int64_t k = 0; k < num_schemes; ++k) {
          if (gpus.data()[k] < 1) throw std::invalid_argument("gpus: counts must be positive");
        }
        if (units < 1 || !(step > 0.0)) {
          throw std::invalid_argument("units must be at least 1 and step positive");
        }
        py::array_t<double> t({units + 1, num_intervals + 1});
        py::array_t<int64_t> choice({units + 1, num_intervals + 1, int64_t{3}});
        double* t_data = t.mutable_data();
        int64_t* choice_data = choice.mutable_data();
        {
          py::gil_scoped_release release;
          proposal_dp(work.data(), gpus.data(), num_intervals, num_schemes, units, step, t_data,
                      choice_data);
        }
        return py::make_tuple(t, choice);
      },
      py::arg("work"), py::arg("gpus"), py::arg("units"), py::arg("step"),
      "Hydraulis' proposal DP (Eq. 4) on a grid: t (units + 1, L + 1) and the choice per "
      "state (scheme, pipelines in steps, block start; -1 where t[n][l] = t[n - 1][l]).");
}
