// Gloo's transport types, held by pointer in ProcessGroupGloo.hpp (see ../algorithm.h).
#pragma once
namespace gloo {
namespace transport {
class Device;
class UnboundBuffer;
}  // namespace transport
}  // namespace gloo
