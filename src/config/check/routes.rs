//! `[[route]]`: each route's own keys, its policy, and the rules between
//! routes (order, names).

use super::Checker;
use crate::config::locate::route_span;
use crate::config::raw::RawRoute;
use crate::config::{rules, Policy, Route};

/// The name of the `index`th route in keys: `route[1]`.
fn route_at(index: usize) -> String {
    format!("route[{index}]")
}

impl Checker<'_> {
    /// The routes; none in the file: the catch-all with the `[defaults]`
    /// policy.
    pub(super) fn routes(
        &mut self,
        raw: &[RawRoute],
        template: Option<&Route>,
        defaults: Option<&Policy>,
    ) -> Option<Vec<Route>> {
        if raw.is_empty() {
            let (template, defaults) = (template?, defaults?);
            return Some(vec![Route {
                policy: defaults.clone(),
                ..template.clone()
            }]);
        }
        let routes: Vec<Option<Route>> = raw
            .iter()
            .enumerate()
            .map(|(index, route)| self.route(index, route, template, defaults))
            .collect();
        self.check_route_order(raw, template);
        routes.into_iter().collect()
    }

    fn route(
        &mut self,
        index: usize,
        raw: &RawRoute,
        template: Option<&Route>,
        defaults: Option<&Policy>,
    ) -> Option<Route> {
        let at = route_at(index);
        let path_prefix = get!(self, [at].path_prefix, raw, template, rules::path_prefix);
        let tenant_header =
            get!(self, [at].tenant_header, raw, optional template, rules::header_name);
        let tenant_required = get!(self, [at].tenant_required, raw, template, rules::flag);
        let tenant_hash = get!(self, [at].tenant_hash, raw, template, rules::flag);
        if let Some(None) = tenant_header {
            for (name, flag) in [named!(raw.tenant_required), named!(raw.tenant_hash)] {
                if let Some(v) = flag.as_ref().filter(|v| *v.get_ref()) {
                    self.report(
                        &format!("{at}.{name}"),
                        Some(v.span()),
                        format!("{name} = true needs tenant_header: without it there is no tenant"),
                    );
                }
            }
        }
        let name = get!(self, [at].name, raw, else path_prefix.clone(), |v: &str| {
            if v.trim().is_empty() {
                Err("must not be empty")
            } else {
                Ok(v.to_string())
            }
        });
        let policy = self.policy(&at, &raw.policy(), defaults);
        Some(Route {
            name: name?,
            path_prefix: path_prefix?,
            tenant_header: tenant_header?,
            tenant_required: tenant_required?,
            tenant_hash: tenant_hash?,
            policy: policy?,
        })
    }

    /// First match wins, so a route after a shorter prefix of its own is
    /// dead; and names label metrics, so explicit names must be unique.
    /// Works from the prefixes and names alone, so a route with other
    /// problems is still checked.
    fn check_route_order(&mut self, raw: &[RawRoute], template: Option<&Route>) {
        let prefixes: Vec<Option<&str>> = raw
            .iter()
            .map(|route| match &route.path_prefix {
                Some(v) => Some(v.get_ref().as_str()).filter(|p| p.starts_with('/')),
                None => template.map(|t| t.path_prefix.as_str()),
            })
            .collect();
        let names: Vec<Option<&str>> = raw
            .iter()
            .zip(&prefixes)
            .map(|(route, prefix)| match &route.name {
                Some(v) => Some(v.get_ref().as_str()),
                None => *prefix,
            })
            .collect();
        for (later, (route, prefix)) in raw.iter().zip(&prefixes).enumerate() {
            let at = route_at(later);
            let shadowing =
                prefix.and_then(|prefix| {
                    prefixes.iter().take(later).enumerate().find_map(|(i, p)| {
                        p.filter(|p| prefix.starts_with(p)).map(|p| (i, p, prefix))
                    })
                });
            if let Some((earlier, earlier_prefix, prefix)) = shadowing {
                let span = match &route.path_prefix {
                    Some(v) => Some(v.span()),
                    None => route_span(self.text, later),
                };
                self.report(
                    &key!([at].path_prefix),
                    span,
                    format!(
                        "unreachable: route[{earlier}] ({earlier_prefix:?}) comes first and matches every path {prefix:?} matches; list the more specific prefix first"
                    ),
                );
            }
            if let Some(name) = &route.name {
                let duplicate = names
                    .iter()
                    .take(later)
                    .position(|n| *n == Some(name.get_ref().as_str()));
                if let Some(earlier) = duplicate {
                    self.bad::<_, ()>(
                        &key!([at].name),
                        name,
                        format!(
                            "duplicate route name {:?} (also route[{earlier}])",
                            name.get_ref()
                        ),
                    );
                }
            }
        }
    }
}
