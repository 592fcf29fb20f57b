// Registration hooks: each C++ source file binds its own functions into the module.
#pragma once

#include <pybind11/pybind11.h>

#include <limits>

// The DPs' "no plan" cost.
inline constexpr double kInf = std::numeric_limits<double>::infinity();

void register_microbatch_dp(pybind11::module_& m);
void register_schedule(pybind11::module_& m);     // schedule_sim.cpp: 1F1B, adaptive, timeline
void register_dispatch(pybind11::module_& m);     // dispatch.cpp: Hydraulis greedy dispatch
void register_packing(pybind11::module_& m);      // packing.cpp: Hydraulis LPT packing (Eq. 1)
void register_layer_dp(pybind11::module_& m);     // layer_dp.cpp: Galvatron-BMW layer DP
void register_first_fit(pybind11::module_& m);    // first_fit.cpp: first-fit-decreasing rows
void register_proposal_dp(pybind11::module_& m);  // proposal_dp.cpp: Hydraulis proposal DP
