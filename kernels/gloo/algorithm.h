// The Gloo declarations ProcessGroupGloo.hpp names (the torch wheel ships c10d's headers but
// not Gloo's): every Gloo object there is held by pointer, so declarations are enough for
// dist.cpp, which only constructs c10d's own classes. See ../dist.cpp.
#pragma once
#include "gloo/context.h"
