// gloo::Context as ProcessGroupGloo.hpp's inline code names it (see algorithm.h).
#pragma once
#include <chrono>
namespace gloo {
class Context {
 public:
  void setTimeout(std::chrono::milliseconds timeout);
};
}  // namespace gloo
