// Galvatron-BMW layer DP: seed galvatron_bmw.txt §IV-A2, Eq. 4, App. A (Algorithm 3).
// Mirrors dynapipe_planner/search/layer_dp.py's layer_dp_reference step for step (same float
// arithmetic, same tie-breaking: the previous layer's strategy within kTieRel, else the lowest
// strategy index), so both return identical plans.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "core.h"

namespace py = pybind11;

namespace {

using Doubles = py::array_t<double, py::array::c_style | py::array::forcecast>;
using Ints = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

constexpr double kInf = std::numeric_limits<double>::infinity();

struct Tables {
  int64_t layers, strategies, budget;
  std::vector<double> best;   // C(L, e) for e = 0..budget, after the last layer: (budget+1, S)
  std::vector<int16_t> from;  // back pointers: (L, budget+1, S), previous layer's strategy
};

// Ties: a layer keeps the previous layer's strategy s when that costs at most kTieRel (relative)
// more than the best predecessor, so equal-cost plans come out as runs of one strategy (sums of
// the same costs in another order differ in the last bits, hence a tolerance, not equality).
constexpr double kTieRel = 1e-13;

// Previous strategies p whose transformation rows R(l, p, .) are identical form one class
// (strategies with the same activation layout); min over p of C(l-1, e, p) + R(l, p, s) is then
// the min over classes of (least C(l-1, e, p) in the class) + R(l, class, s): the same values,
// |classes| instead of |S| terms per state. Classes are listed by their lowest member.
struct Classes {
  std::vector<int64_t> of;                    // class index of every strategy
  std::vector<std::vector<int64_t>> members;  // increasing strategy indices
};

Classes row_classes(const double* transform, int64_t S) {
  Classes c{std::vector<int64_t>(S, -1), {}};
  for (int64_t p = 0; p < S; ++p) {
    const double* row = transform + p * S;
    for (size_t k = 0; k < c.members.size() && c.of[p] < 0; ++k) {
      const double* rep = transform + c.members[k][0] * S;
      bool same = true;
      for (int64_t s = 0; s < S && same; ++s) same = row[s] == rep[s];
      if (same) {
        c.of[p] = static_cast<int64_t>(k);
        c.members[k].push_back(p);
      }
    }
    if (c.of[p] < 0) {
      c.of[p] = static_cast<int64_t>(c.members.size());
      c.members.push_back({p});
    }
  }
  return c;
}

// C(l, e, s): least objective of layers 0..l with layer l on strategy s and forward memory
// (activations in flight + model states, in bins) at most e. C(0, e, s) has no transformation
// term; later layers add R(l, s', s) from the previous layer's strategy s'.
// Only budgets lo_l <= e <= hi_l are computed, lo_l (hi_l) being the sum of the least (most)
// weights of layers 0..l: below lo_l nothing fits, and from hi_l on every assignment fits, so
// those rows (values and back pointers) equal row hi_l. Both shortcuts give the same values
// as computing every row.
Tables run_dp(const double* objective, const int64_t* weight, const double* transform,
              int64_t layers, int64_t strategies, int64_t budget) {
  const int64_t S = strategies, E = budget + 1;
  Tables t{layers, strategies, budget, std::vector<double>(E * S, kInf),
           std::vector<int16_t>(layers * E * S, -1)};
  // Least and most weight of layer l over its usable strategies (lo > E: none usable).
  auto bounds = [&](int64_t l, int64_t* lo, int64_t* hi) {
    *lo = E + 1;
    *hi = 0;
    for (int64_t s = 0; s < S; ++s) {
      if (!(objective[l * S + s] < kInf)) continue;
      if (weight[l * S + s] < *lo) *lo = weight[l * S + s];
      if (weight[l * S + s] > *hi) *hi = weight[l * S + s];
    }
  };
  int64_t lo = 0, hi = 0;
  bounds(0, &lo, &hi);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t s = 0; s < S; ++s) {
      const double c = objective[s];
      if (c < kInf && weight[s] <= e) t.best[e * S + s] = c;
    }
  }
  std::vector<double> cur(E * S), gmin, rt;  // rt[s * G + g] = R(l, class g, s)
  std::vector<int64_t> garg;
  Classes cls;
  int64_t G = 0;
  for (int64_t l = 1; l < layers; ++l) {
    const double* obj = objective + l * S;
    const int64_t* w = weight + l * S;
    const double* tr = transform + l * S * S;  // tr[p * S + s] = R(l, p, s)
    // Identical layers have identical transformation matrices: keep the previous classes.
    if (l == 1 || !std::equal(tr, tr + S * S, tr - S * S)) {
      cls = row_classes(tr, S);
      G = static_cast<int64_t>(cls.members.size());
      rt.resize(S * G);
      for (int64_t s = 0; s < S; ++s) {
        for (int64_t g = 0; g < G; ++g) rt[s * G + g] = tr[cls.members[g][0] * S + s];
      }
    }
    int64_t wlo = 0, whi = 0;
    bounds(l, &wlo, &whi);
    const int64_t prev_lo = lo, prev_hi = std::min(hi, E - 1);
    lo = std::min(lo + wlo, E);  // E: no row is feasible
    hi = hi + whi;
    // Least C(l - 1, e, p) over each class's members (lowest index among equal values), for
    // the rows that can be feasible and are not copies of row prev_hi.
    gmin.assign(E * G, kInf);
    garg.assign(E * G, -1);
    for (int64_t e = prev_lo; e <= prev_hi; ++e) {
      const double* prev = t.best.data() + e * S;
      for (int64_t g = 0; g < G; ++g) {
        for (const int64_t p : cls.members[g]) {
          if (prev[p] < gmin[e * G + g]) {
            gmin[e * G + g] = prev[p];
            garg[e * G + g] = p;
          }
        }
      }
    }
    int16_t* ptr = t.from.data() + l * E * S;
    const int64_t top = std::min(hi, E - 1);
    std::fill(cur.begin(), cur.begin() + std::min(lo, E) * S, kInf);
    for (int64_t e = lo; e <= top; ++e) {
      for (int64_t s = 0; s < S; ++s) {
        cur[e * S + s] = kInf;
        if (!(obj[s] < kInf) || w[s] > e) continue;
        const int64_t from = std::min(e - w[s], prev_hi);
        if (from < prev_lo) continue;
        const double* gm = gmin.data() + from * G;
        const double* r = rt.data() + s * G;
        double best = kInf;
        int64_t bg = -1;
        for (int64_t g = 0; g < G; ++g) {
          const double v = gm[g] + r[g];
          if (v < best) {
            best = v;
            bg = g;
          }
        }
        if (bg < 0) continue;
        int64_t arg = garg[from * G + bg];
        if (arg != s) {
          const double own = t.best[from * S + s] + tr[s * S + s];
          if (own < kInf && own - best <= kTieRel * std::abs(best)) {
            best = own;
            arg = s;
          }
        }
        cur[e * S + s] = best + obj[s];
        ptr[e * S + s] = static_cast<int16_t>(arg);
      }
    }
    for (int64_t e = top + 1; e < E; ++e) {
      std::copy(cur.begin() + top * S, cur.begin() + (top + 1) * S, cur.begin() + e * S);
      std::copy(ptr + top * S, ptr + (top + 1) * S, ptr + e * S);
    }
    t.best.swap(cur);
  }
  return t;
}

// Strategies of every layer for forward budget e (empty when C(L, e) is infinite).
std::vector<int64_t> backtrack(const Tables& t, const int64_t* weight, int64_t e, double* cost) {
  const int64_t S = t.strategies, E = t.budget + 1;
  int64_t s = -1;
  double best = kInf;
  for (int64_t j = 0; j < S; ++j) {
    if (t.best[e * S + j] < best) {
      best = t.best[e * S + j];
      s = j;
    }
  }
  *cost = best;
  if (s < 0) return {};
  std::vector<int64_t> chosen(t.layers);
  for (int64_t l = t.layers - 1; l >= 0; --l) {
    chosen[l] = s;
    if (l == 0) break;
    const int64_t prev = t.from[(l * E + e) * S + s];
    e -= weight[l * S + s];
    s = prev;
  }
  return chosen;
}

// Eq. 2: max over layers i of (forward bytes of layers <= i + backward peak of i), plus all
// model states.
double peak_memory(const double* fwd, const double* bwd, const double* states,
                   const std::vector<int64_t>& chosen, int64_t S) {
  double running = 0.0, peak = 0.0, total_states = 0.0;
  for (size_t l = 0; l < chosen.size(); ++l) {
    const int64_t j = static_cast<int64_t>(l) * S + chosen[l];
    running += fwd[j];
    const double here = running + bwd[j];
    if (here > peak) peak = here;
    total_states += states[j];
  }
  return peak + total_states;
}

void check_shapes(const Doubles& objective, const Ints& weight, const Doubles& transform) {
  if (objective.ndim() != 2 || weight.ndim() != 2 || transform.ndim() != 3) {
    throw std::invalid_argument("layer_dp: objective (L, S), weight (L, S), transform (L, S, S)");
  }
  const int64_t L = objective.shape(0), S = objective.shape(1);
  if (L < 1 || S < 1 || S > std::numeric_limits<int16_t>::max() || weight.shape(0) != L ||
      weight.shape(1) != S || transform.shape(0) != L || transform.shape(1) != S ||
      transform.shape(2) != S) {
    throw std::invalid_argument("layer_dp: objective, weight and transform do not match");
  }
}

// The DP table's last row: min over strategies of C(L, e) for every e = 0..budget.
Doubles layer_dp_table(const Doubles& objective, const Ints& weight, const Doubles& transform,
                       int64_t budget) {
  check_shapes(objective, weight, transform);
  if (budget < 0) throw std::invalid_argument("layer_dp: budget must be >= 0");
  const int64_t L = objective.shape(0), S = objective.shape(1);
  Tables t;
  {
    py::gil_scoped_release release;
    t = run_dp(objective.data(), weight.data(), transform.data(), L, S, budget);
  }
  Doubles out(budget + 1);
  double* o = out.mutable_data();
  for (int64_t e = 0; e <= budget; ++e) {
    double best = kInf;
    for (int64_t s = 0; s < S; ++s) {
      if (t.best[e * S + s] < best) best = t.best[e * S + s];
    }
    o[e] = best;
  }
  return out;
}

// Algorithm 3: the largest forward budget e <= budget whose plan's Eq. 2 peak fits in
// `memory_limit`; plans with e <= `unchecked_bins` fit by construction (E - b_up bound).
// Returns (objective, strategy per layer, e); objective is inf and the list empty if none fits.
std::tuple<double, std::vector<int64_t>, int64_t> layer_dp_search(
    const Doubles& objective, const Ints& weight, const Doubles& transform, const Doubles& fwd,
    const Doubles& bwd, const Doubles& states, int64_t budget, double memory_limit,
    int64_t unchecked_bins) {
  check_shapes(objective, weight, transform);
  const int64_t L = objective.shape(0), S = objective.shape(1);
  for (const Doubles* a : {&fwd, &bwd, &states}) {
    if (a->ndim() != 2 || a->shape(0) != L || a->shape(1) != S) {
      throw std::invalid_argument("layer_dp: fwd, bwd and states must be (L, S)");
    }
  }
  if (budget < 0) return {kInf, {}, -1};
  py::gil_scoped_release release;
  const Tables t = run_dp(objective.data(), weight.data(), transform.data(), L, S, budget);
  for (int64_t e = budget; e >= 0; --e) {
    double cost = kInf;
    std::vector<int64_t> chosen = backtrack(t, weight.data(), e, &cost);
    if (chosen.empty()) break;  // C(L, e) only grows as e shrinks
    if (e <= unchecked_bins ||
        peak_memory(fwd.data(), bwd.data(), states.data(), chosen, S) <= memory_limit) {
      return {cost, chosen, e};
    }
  }
  return {kInf, {}, -1};
}

}  // namespace

void register_layer_dp(py::module_& m) {
  m.def("layer_dp_table", &layer_dp_table, py::arg("objective"), py::arg("weight"),
        py::arg("transform"), py::arg("budget"),
        "Galvatron-BMW Eq. 4: min objective of all layers for each forward budget 0..budget.");
  m.def("layer_dp_search", &layer_dp_search, py::arg("objective"), py::arg("weight"),
        py::arg("transform"), py::arg("fwd"), py::arg("bwd"), py::arg("states"), py::arg("budget"),
        py::arg("memory_limit"), py::arg("unchecked_bins"),
        "Galvatron-BMW Algorithm 3: (objective, strategy per layer, forward budget).");
}
