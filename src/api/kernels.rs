//! `GET /v1/kernels`: the kernels this broker offers (its kernel specs whose runtime the
//! host has), by the names `POST /v1/sessions {"kernel"}` takes, with their aliases.

use axum::extract::State;
use axum::Json;
use serde::Serialize;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::Caller;
use super::shapes::ErrorResponse;
use super::AppState;

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(list))
}

/// One kernel.
#[derive(Serialize, ToSchema)]
pub struct KernelJson {
    /// What `POST /v1/sessions {"kernel"}` takes.
    name: String,
    display_name: String,
    /// The language, as the kernel spec names it (`python`, `R`, `typescript`, ...).
    language: String,
    /// Other names `POST /v1/sessions` and E2B's `language` take for it (`ir`, `js`, `ts`).
    aliases: Vec<String>,
}

/// The kernels.
#[derive(Serialize, ToSchema)]
pub struct KernelsJson {
    /// The kernel a session gets when it names none.
    default: String,
    kernels: Vec<KernelJson>,
}

/// The kernels this broker offers
#[utoipa::path(get, operation_id = "list_kernel_specs", path = "/v1/kernels", tag = "sessions",
    responses((status = 200, description = "ok", body = KernelsJson), (status = 401, response = ErrorResponse)))]
async fn list(State(state): State<AppState>, _caller: Caller) -> Json<KernelsJson> {
    let specs = &state.kernelspecs;
    Json(KernelsJson {
        default: specs.default_name().to_string(),
        kernels: specs
            .iter()
            .map(|s| KernelJson {
                name: s.name.clone(),
                display_name: s.display_name.clone(),
                language: s.language.clone(),
                aliases: specs
                    .aliases_of(&s.name)
                    .into_iter()
                    .map(String::from)
                    .collect(),
            })
            .collect(),
    })
}
