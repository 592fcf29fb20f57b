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
#include <memory>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "core.h"

namespace py = pybind11;

namespace {

using Doubles = py::array_t<double, py::array::c_style | py::array::forcecast>;
using Ints = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

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
//
// The DP over layers 0..n-1 is the first n steps of the DP over more layers, so one instance
// answers every prefix length: `extend` runs the recurrence as far as asked and keeps, per
// layer, the back pointers and min_s C(l, e, s) with its argmin.
class LayerDP {
 public:
  LayerDP(const double* objective, const int64_t* weight, const double* transform, int64_t layers,
          int64_t strategies, int64_t budget)
      : S_(strategies),
        E_(budget + 1),
        layers_(layers),
        objective_(objective, objective + layers * strategies),
        weight_(weight, weight + layers * strategies),
        transform_(transform, transform + layers * strategies * strategies),
        best_(E_ * S_, kInf),
        cur_(E_ * S_) {}

  int64_t layers() const { return layers_; }
  int64_t budget() const { return E_ - 1; }

  // Runs the recurrence up to `n` layers (at most the instance's).
  void extend(int64_t n) {
    while (done_ < n) step();
  }

  // min_s C(n - 1, e, s) and its strategy (-1 when infinite); needs extend(n).
  double row_min(int64_t n, int64_t e) const { return rowmin_[(n - 1) * E_ + e]; }
  int64_t row_arg(int64_t n, int64_t e) const { return rowarg_[(n - 1) * E_ + e]; }

  // Strategies of layers 0..n-1 for forward budget e, ending on `s` at layer n - 1.
  std::vector<int64_t> backtrack(int64_t n, int64_t e, int64_t s) const {
    std::vector<int64_t> chosen(n);
    for (int64_t l = n - 1; l >= 0; --l) {
      chosen[l] = s;
      if (l == 0) break;
      const int64_t prev = from_[(l * E_ + e) * S_ + s];
      e -= weight_[l * S_ + s];
      s = prev;
    }
    return chosen;
  }

 private:
  void bounds(int64_t l, int64_t* lo, int64_t* hi) const {
    *lo = E_ + 1;
    *hi = 0;
    for (int64_t s = 0; s < S_; ++s) {
      if (!(objective_[l * S_ + s] < kInf)) continue;
      if (weight_[l * S_ + s] < *lo) *lo = weight_[l * S_ + s];
      if (weight_[l * S_ + s] > *hi) *hi = weight_[l * S_ + s];
    }
  }

  void record_row() {
    from_.resize((done_ + 1) * E_ * S_, -1);
    rowmin_.resize((done_ + 1) * E_, kInf);
    rowarg_.resize((done_ + 1) * E_, -1);
    for (int64_t e = 0; e < E_; ++e) {
      double m = kInf;
      int64_t arg = -1;
      for (int64_t s = 0; s < S_; ++s) {
        if (best_[e * S_ + s] < m) {
          m = best_[e * S_ + s];
          arg = s;
        }
      }
      rowmin_[done_ * E_ + e] = m;
      rowarg_[done_ * E_ + e] = arg;
    }
  }

  void step() {
    const int64_t S = S_, E = E_;
    if (done_ == 0) {
      bounds(0, &lo_, &hi_);
      for (int64_t e = 0; e < E; ++e) {
        for (int64_t s = 0; s < S; ++s) {
          const double c = objective_[s];
          if (c < kInf && weight_[s] <= e) best_[e * S + s] = c;
        }
      }
      from_.assign(E * S, -1);
      record_row();
      done_ = 1;
      return;
    }
    const int64_t l = done_;
    const double* obj = objective_.data() + l * S;
    const int64_t* w = weight_.data() + l * S;
    const double* tr = transform_.data() + l * S * S;  // tr[p * S + s] = R(l, p, s)
    // Identical layers have identical transformation matrices: keep the previous classes.
    if (l == 1 || !std::equal(tr, tr + S * S, tr - S * S)) {
      cls_ = row_classes(tr, S);
      G_ = static_cast<int64_t>(cls_.members.size());
      rt_.resize(S * G_);  // rt[s * G + g] = R(l, class g, s)
      for (int64_t s = 0; s < S; ++s) {
        for (int64_t g = 0; g < G_; ++g) rt_[s * G_ + g] = tr[cls_.members[g][0] * S + s];
      }
    }
    const int64_t G = G_;
    int64_t wlo = 0, whi = 0;
    bounds(l, &wlo, &whi);
    const int64_t prev_lo = lo_, prev_hi = std::min(hi_, E - 1);
    lo_ = std::min(lo_ + wlo, E);  // E: no row is feasible
    hi_ = hi_ + whi;
    // Least C(l - 1, e, p) over each class's members (lowest index among equal values), for
    // the rows that can be feasible and are not copies of row prev_hi.
    gmin_.assign(E * G, kInf);
    garg_.assign(E * G, -1);
    for (int64_t e = prev_lo; e <= prev_hi; ++e) {
      const double* prev = best_.data() + e * S;
      for (int64_t g = 0; g < G; ++g) {
        for (const int64_t p : cls_.members[g]) {
          if (prev[p] < gmin_[e * G + g]) {
            gmin_[e * G + g] = prev[p];
            garg_[e * G + g] = p;
          }
        }
      }
    }
    from_.resize((l + 1) * E * S, -1);
    int16_t* ptr = from_.data() + l * E * S;
    const int64_t top = std::min(hi_, E - 1);
    std::fill(cur_.begin(), cur_.begin() + std::min(lo_, E) * S, kInf);
    for (int64_t e = lo_; e <= top; ++e) {
      for (int64_t s = 0; s < S; ++s) {
        cur_[e * S + s] = kInf;
        if (!(obj[s] < kInf) || w[s] > e) continue;
        const int64_t from = std::min(e - w[s], prev_hi);
        if (from < prev_lo) continue;
        const double* gm = gmin_.data() + from * G;
        const double* r = rt_.data() + s * G;
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
        int64_t arg = garg_[from * G + bg];
        if (arg != s) {
          const double own = best_[from * S + s] + tr[s * S + s];
          if (own < kInf && own - best <= kTieRel * std::abs(best)) {
            best = own;
            arg = s;
          }
        }
        cur_[e * S + s] = best + obj[s];
        ptr[e * S + s] = static_cast<int16_t>(arg);
      }
    }
    for (int64_t e = top + 1; e < E; ++e) {
      std::copy(cur_.begin() + top * S, cur_.begin() + (top + 1) * S, cur_.begin() + e * S);
      std::copy(ptr + top * S, ptr + (top + 1) * S, ptr + e * S);
    }
    best_.swap(cur_);
    record_row();
    done_ = l + 1;
  }

  int64_t S_, E_, layers_;
  std::vector<double> objective_;
  std::vector<int64_t> weight_;
  std::vector<double> transform_;
  std::vector<double> best_, cur_, gmin_, rt_;
  std::vector<int64_t> garg_;
  std::vector<int16_t> from_;    // back pointers: (layers done, E, S)
  std::vector<double> rowmin_;   // (layers done, E)
  std::vector<int64_t> rowarg_;  // (layers done, E)
  Classes cls_;
  int64_t G_ = 0, done_ = 0, lo_ = 0, hi_ = 0;
};

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

// Algorithm 3 on the first n layers: the largest forward budget e whose plan's Eq. 2 peak fits
// in `memory_limit`; plans with e <= `unchecked_bins` fit by construction (E - b_up bound).
// Returns (objective, strategy per layer, e); objective is inf and the list empty if none fits.
std::tuple<double, std::vector<int64_t>, int64_t> algorithm3(LayerDP& dp, int64_t n,
                                                             const double* fwd, const double* bwd,
                                                             const double* states, int64_t S,
                                                             double memory_limit,
                                                             int64_t unchecked_bins) {
  dp.extend(n);
  for (int64_t e = dp.budget(); e >= 0; --e) {
    const int64_t s = dp.row_arg(n, e);
    if (s < 0) break;  // C(n, e) only grows as e shrinks
    std::vector<int64_t> chosen = dp.backtrack(n, e, s);
    if (e <= unchecked_bins || peak_memory(fwd, bwd, states, chosen, S) <= memory_limit) {
      return {dp.row_min(n, e), chosen, e};
    }
  }
  return {kInf, {}, -1};
}

// The DP table's last row: min over strategies of C(L, e) for every e = 0..budget.
Doubles layer_dp_table(const Doubles& objective, const Ints& weight, const Doubles& transform,
                       int64_t budget) {
  check_shapes(objective, weight, transform);
  if (budget < 0) throw std::invalid_argument("layer_dp: budget must be >= 0");
  const int64_t L = objective.shape(0), S = objective.shape(1);
  LayerDP dp(objective.data(), weight.data(), transform.data(), L, S, budget);
  {
    py::gil_scoped_release release;
    dp.extend(L);
  }
  Doubles out(budget + 1);
  double* o = out.mutable_data();
  for (int64_t e = 0; e <= budget; ++e) o[e] = dp.row_min(L, e);
  return out;
}

void check_memory(const Doubles& fwd, const Doubles& bwd, const Doubles& states, int64_t L,
                  int64_t S) {
  for (const Doubles* a : {&fwd, &bwd, &states}) {
    if (a->ndim() != 2 || a->shape(0) != L || a->shape(1) != S) {
      throw std::invalid_argument("layer_dp: fwd, bwd and states must be (L, S)");
    }
  }
}

// Algorithm 3 on all layers of one stage.
std::tuple<double, std::vector<int64_t>, int64_t> layer_dp_search(
    const Doubles& objective, const Ints& weight, const Doubles& transform, const Doubles& fwd,
    const Doubles& bwd, const Doubles& states, int64_t budget, double memory_limit,
    int64_t unchecked_bins) {
  check_shapes(objective, weight, transform);
  const int64_t L = objective.shape(0), S = objective.shape(1);
  check_memory(fwd, bwd, states, L, S);
  if (budget < 0) return {kInf, {}, -1};
  LayerDP dp(objective.data(), weight.data(), transform.data(), L, S, budget);
  py::gil_scoped_release release;
  return algorithm3(dp, L, fwd.data(), bwd.data(), states.data(), S, memory_limit, unchecked_bins);
}

// One DP over up to L layers answering Algorithm 3 for every prefix of them: the stages that
// start at one layer (or, in a model of identical layers, all stages at one pipeline position)
// share it whatever their length.
class PrefixLayerDP {
 public:
  PrefixLayerDP(const Doubles& objective, const Ints& weight, const Doubles& transform,
                const Doubles& fwd, const Doubles& bwd, const Doubles& states, int64_t budget)
      : S_(objective.ndim() == 2 ? objective.shape(1) : 0),
        fwd_(fwd.data(), fwd.data() + fwd.size()),
        bwd_(bwd.data(), bwd.data() + bwd.size()),
        states_(states.data(), states.data() + states.size()) {
    check_shapes(objective, weight, transform);
    check_memory(fwd, bwd, states, objective.shape(0), S_);
    if (budget < 0) throw std::invalid_argument("layer_dp: budget must be >= 0");
    dp_ = std::make_unique<LayerDP>(objective.data(), weight.data(), transform.data(),
                                    objective.shape(0), S_, budget);
  }

  std::tuple<double, std::vector<int64_t>, int64_t> solve(int64_t layers, double memory_limit,
                                                          int64_t unchecked_bins) {
    if (layers < 1 || layers > dp_->layers()) {
      throw std::invalid_argument("layer_dp: prefix length out of range");
    }
    py::gil_scoped_release release;
    return algorithm3(*dp_, layers, fwd_.data(), bwd_.data(), states_.data(), S_, memory_limit,
                      unchecked_bins);
  }

  int64_t layers() const { return dp_->layers(); }
  int64_t budget() const { return dp_->budget(); }

 private:
  int64_t S_;
  std::vector<double> fwd_, bwd_, states_;
  std::unique_ptr<LayerDP> dp_;
};

}  // namespace

void register_layer_dp(py::module_& m) {
  m.def("layer_dp_table", &layer_dp_table, py::arg("objective"), py::arg("weight"),
        py::arg("transform"), py::arg("budget"),
        "Galvatron-BMW Eq. 4: min objective of all layers for each forward budget 0..budget.");
  m.def("layer_dp_search", &layer_dp_search, py::arg("objective"), py::arg("weight"),
        py::arg("transform"), py::arg("fwd"), py::arg("bwd"), py::arg("states"), py::arg("budget"),
        py::arg("memory_limit"), py::arg("unchecked_bins"),
        "Galvatron-BMW Algorithm 3: (objective, strategy per layer, forward budget).");
  py::class_<PrefixLayerDP>(m, "PrefixLayerDP",
                            "Layer DP over up to L layers answering Algorithm 3 for any prefix.")
      .def(py::init<const Doubles&, const Ints&, const Doubles&, const Doubles&, const Doubles&,
                    const Doubles&, int64_t>(),
           py::arg("objective"), py::arg("weight"), py::arg("transform"), py::arg("fwd"),
           py::arg("bwd"), py::arg("states"), py::arg("budget"))
      .def("solve", &PrefixLayerDP::solve, py::arg("layers"), py::arg("memory_limit"),
           py::arg("unchecked_bins"),
           "Algorithm 3 on the first `layers` layers: (objective, strategies, forward budget).")
      .def_property_readonly("layers", &PrefixLayerDP::layers)
      .def_property_readonly("budget", &PrefixLayerDP::budget);
}
