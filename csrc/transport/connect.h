// Setting up a group's transport: the ranks agree on the settings that decide what goes on
// the wire, then pick shared memory or TCP from where they run.
#pragma once

#include <chrono>
#include <memory>

#include "common/env.h"
#include "transport/rendezvous.h"
#include "transport/transport.h"

namespace torchpar {

// Shared memory when every rank of the group runs on this host (host identities are
// exchanged through the store, never guessed from the environment); shared memory within
// each host and TCP between hosts (MixedTransport) when they run on several; TCP between
// every pair when TORCHPAR_TRANSPORT=tcp asks for it. Throws (on every rank alike) if the ranks' settings
// differ, or if TORCHPAR_TRANSPORT=shm and some rank runs elsewhere.
std::unique_ptr<Transport> connect(Rendezvous& rv, int rank, int size, const Config& config,
                                   std::chrono::milliseconds timeout);

}  // namespace torchpar
