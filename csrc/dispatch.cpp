// Greedy sequence dispatch across pipelines: Hydraulis (seed hydraulis.txt) §6.2, Appendix D.2.
// Mirrors dynapipe_planner/strategy/dispatch.py's dispatch_reference step for step (same float
// arithmetic, same tie-breaking), so the two return identical assignments.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core.h"

namespace py = pybind11;

namespace {

using Doubles = py::array_t<double, py::array::c_style | py::array::forcecast>;
using Ints = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

struct Trial {
  std::vector<int64_t> assignment;
  double objective;
};

// One trial of Alg. 1: sequences in `order` each go to the pipeline whose Eq. 2 bound after
// taking it, C_j + T + (PP_j - 1) * max(Tmax_j, T), is smallest (first pipeline on ties).
// Minimising the slowest pipeline's bound (the paper's O_max) is the same choice up to ties:
// O(j) = max(A_j, V_max) for every j, since adding work never lowers a pipeline's bound.
Trial run_trial(const double* cost, int64_t num_schemes, const int64_t* scheme, const int64_t* pp,
                int64_t num_pipelines, const int64_t* order, int64_t num_seq) {
  std::vector<double> work(num_pipelines, 0.0), longest(num_pipelines, 0.0);
  Trial trial{std::vector<int64_t>(num_seq, -1), 0.0};
  for (int64_t k = 0; k < num_seq; ++k) {
    const int64_t i = order[k];
    double best = std::numeric_limits<double>::infinity();
    int64_t arg = -1;
    for (int64_t j = 0; j < num_pipelines; ++j) {
      const double t = cost[i * num_schemes + scheme[j]];
      if (!(t < std::numeric_limits<double>::infinity())) continue;  // beyond MaxLen(P_j)
      const double tmax = longest[j] > t ? longest[j] : t;
      const double bound = work[j] + t + static_cast<double>(pp[j] - 1) * tmax;
      if (bound < best) {
        best = bound;
        arg = j;
      }
    }
    if (arg < 0) {
      throw std::invalid_argument("sequence " + std::to_string(i) + " fits no pipeline");
    }
    const double t = cost[i * num_schemes + scheme[arg]];
    work[arg] += t;
    if (t > longest[arg]) longest[arg] = t;
    trial.assignment[i] = arg;
  }
  for (int64_t j = 0; j < num_pipelines; ++j) {
    const double bound = work[j] + static_cast<double>(pp[j] - 1) * longest[j];
    if (bound > trial.objective) trial.objective = bound;
  }
  return trial;
}

std::tuple<Ints, double> dispatch_greedy(const Doubles& cost, const Ints& scheme, const Ints& pp,
                                         const Ints& orders) {
  if (cost.ndim() != 2 || scheme.ndim() != 1 || pp.ndim() != 1 || orders.ndim() != 2) {
    throw std::invalid_argument("dispatch: cost (B, K), scheme (D,), pp (D,), orders (T, B)");
  }
  const int64_t num_seq = cost.shape(0), num_schemes = cost.shape(1);
  const int64_t num_pipelines = scheme.shape(0), trials = orders.shape(0);
  if (pp.shape(0) != num_pipelines || orders.shape(1) != num_seq || trials < 1) {
    throw std::invalid_argument("dispatch: pp, scheme and orders do not match the costs");
  }
  for (int64_t j = 0; j < num_pipelines; ++j) {
    if (scheme.data()[j] < 0 || scheme.data()[j] >= num_schemes || pp.data()[j] < 1) {
      throw std::invalid_argument("dispatch: pipeline " + std::to_string(j) +
                                  " has no valid scheme or PP degree");
    }
  }
  Trial best{{}, std::numeric_limits<double>::infinity()};
  {
    py::gil_scoped_release release;
    for (int64_t r = 0; r < trials; ++r) {
      Trial trial = run_trial(cost.data(), num_schemes, scheme.data(), pp.data(), num_pipelines,
                              orders.data() + r * num_seq, num_seq);
      if (trial.objective < best.objective) best = std::move(trial);
    }
  }
  Ints assignment(num_seq);
  for (int64_t i = 0; i < num_seq; ++i) assignment.mutable_data()[i] = best.assignment[i];
  return {assignment, best.objective};
}

}  // namespace

void register_dispatch(py::module_& m) {
  m.def("dispatch_greedy", &dispatch_greedy, py::arg("cost"), py::arg("scheme"), py::arg("pp"),
        py::arg("orders"),
        "Hydraulis Alg. 1: best of the given random orders; returns (pipeline per sequence, "
        "slowest pipeline's Eq. 2 bound).");
}
